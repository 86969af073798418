"""The worker core's hands on its step engine: gives it requests, steps it, and starts it
over when `step()` raises.

After a plain exception from `step()` (or `has_work()`), the engine is reset — its own
`reset()` (`ResettableEngine`), else built anew from its factory (`cls(**options)`, the
old one closed) — and the requests of the failed step are given to it again, with their
original inputs (a `ChunkStream` rewound: what arrived so far, then what still comes).
`poison.Quarantine` decides who goes back in, who waits and who is the poison. A re-run
request's outputs are counted against what it had sent: the first that many are
dropped, so the client's `seq` runs on with no repeat (the engine must re-run
deterministically; docs/stages.md). An engine that can be neither reset nor rebuilt (a
function stage's) fails every request it holds, as it always did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised
from omni_runtime.logs import for_request as _rid
from omni_runtime.observe.metrics import Metrics
from omni_runtime.stage_api import (
    ChunkStream,
    ClosableEngine,
    EngineOutput,
    ResettableEngine,
    StageEngine,
    StepFailed,
    takes_params,
)
from omni_runtime.worker.poison import POISON_STRIKES, Quarantine

log = logging.getLogger(__name__)

Failures = list[tuple[str, str]]
"""`(request id, error)`: requests that end with this error."""


@dataclass(slots=True)
class Stepped:
    """One step's outcome: outputs to publish, requests to end with an error; `again`: the
    engine was started over or given held requests, so it should step again at once."""

    outputs: list[EngineOutput] = field(default_factory=list)
    failed: Failures = field(default_factory=list)
    again: bool = False


@dataclass(slots=True)
class _Given:
    """What a request gave the engine, to give it again after a reset."""

    data: Any
    params: dict[str, Any] | None = None
    runs: int = 0
    sent: int = 0
    """Its outputs passed on (re-runs: only those past `skip`)."""
    skip: int = 0
    """Outputs its re-run has still to make before it makes new ones."""


class EngineDriver:
    def __init__(
        self,
        engine: StageEngine,
        stage_id: int,
        stage_name: str,
        metrics: Metrics,
        *,
        rebuild: Callable[[], StageEngine] | None = None,
        poison_strikes: int = POISON_STRIKES,
    ) -> None:
        self.engine = engine
        self.stage_id = stage_id
        self.stage_name = stage_name
        self.metrics = metrics
        self._stage = str(stage_id)
        self._rebuild = rebuild
        self._counts = rebuild is not None or isinstance(engine, ResettableEngine)
        """Whether outputs are counted per request: only an engine that can start over re-runs."""
        self.quarantine = Quarantine(poison_strikes)
        self._given: dict[str, _Given] = {}
        self._takes_params = takes_params(engine.add_request)

    def add(self, request_id: str, data: Any, params: dict[str, Any] | None = None) -> str | None:
        """A new request: to the engine now, or held back while a bisection runs. Returns
        the error if `add_request` raised."""
        self._given[request_id] = _Given(data, params)
        if not self.quarantine.arrive(request_id):
            return None
        return self._give(request_id)

    def drop(self, request_id: str, abort: bool) -> None:
        """The request ended here; `abort`: the engine may still be working on it."""
        in_engine = self.quarantine.is_in_engine(request_id)
        self.quarantine.forget(request_id)
        self._given.pop(request_id, None)
        if abort and in_engine:
            aborted = foreign.call(self.engine.abort, request_id)
            if isinstance(aborted, Raised):  # the request is dropped all the same
                log.error(
                    "stage %d: abort() raised",
                    self.stage_id,
                    exc_info=aborted.error,
                    extra=_rid(request_id),
                )

    def step(self) -> Stepped | None:
        """Step the engine if it has work; None if there was nothing to do."""
        admitted = self.quarantine.idle()
        failed = self._give_all(admitted)
        method = "has_work"
        has_work = foreign.call(self.engine.has_work)
        outputs: list[EngineOutput] | Raised = []
        if isinstance(has_work, Raised):
            outputs = has_work
        elif not has_work:
            return Stepped(failed=failed, again=bool(admitted)) if admitted else None
        else:
            method = "step"
            outputs = foreign.call(self.engine.step)
        if isinstance(outputs, Raised):
            e = outputs.error
            if isinstance(e, StepFailed):
                error = f"{self.stage_name} step() failed: {e}"
                log.error("stage %d: %s (requests %s)", self.stage_id, error, e.request_ids)
                return Stepped(failed=failed + [(rid, error) for rid in e.request_ids])
            ended, again = self._start_over(self.describe(method, e))  # the engine starts over
            return Stepped(failed=failed + ended, again=again)
        if self._counts:
            outputs = self._unsent(outputs, failed)
        admitted = self.quarantine.stepped()
        failed += self._give_all(admitted)
        return Stepped(outputs, failed, bool(admitted))

    def close(self) -> None:
        """At shutdown: the engine's `close()` (`ClosableEngine`), of the one it is now."""
        self._close(self.engine)

    def describe(self, method: str, e: Exception) -> str:
        """Log an engine method's exception; the error its requests end with."""
        log.error(
            "stage %d (%s): engine %s() raised", self.stage_id, self.stage_name, method, exc_info=e
        )
        return f"{self.stage_name} {method}() raised {type(e).__name__}: {e}"

    def _start_over(self, error: str) -> tuple[Failures, bool]:
        """After a failed step: reset the engine and give it back the step's requests. The
        requests that end, and whether any went back in (to step again at once)."""
        if not self._reset():  # the engine is as the failure left it: its requests end
            return [(rid, error) for rid in self.quarantine.in_engine], False
        verdict = self.quarantine.failed()
        self.metrics.inc("omni_engine_resets_total", stage=self._stage)
        log.warning(
            "stage %d: engine reset after a failed step (%d so far); %d requests blamed, "
            "%d run again, %d held back, %d taken for poison",
            *(self.stage_id, self.quarantine.failed_steps, len(verdict.blamed)),
            *(len(verdict.readmitted), len(verdict.held_back), len(verdict.poisoned)),
        )
        failed: Failures = []
        for rid in verdict.poisoned:
            self._given.pop(rid, None)
            n = verdict.strikes[rid]
            self.metrics.inc("omni_poison_requests_total", stage=self._stage)
            log.error("stage %d: poison: in %d failed steps", self.stage_id, n, extra=_rid(rid))
            failed.append((rid, f"{error} (poison: this request was in {n} failed steps)"))
        return failed + self._give_all(verdict.readmitted), bool(verdict.readmitted)

    def _reset(self) -> bool:
        """The engine's `reset()`, else a new one from the factory; False: neither worked."""
        engine = self.engine
        if isinstance(engine, ResettableEngine):
            reset = foreign.call(engine.reset)
            if not isinstance(reset, Raised):
                return True
            log.error("stage %d: engine reset() raised", self.stage_id, exc_info=reset.error)
        if self._rebuild is None:
            return False
        new = foreign.call(self._rebuild)  # the new one first: if it cannot be built, the
        if isinstance(new, Raised):  # old one is all there is
            log.error(
                "stage %d: the engine could not be built anew", self.stage_id, exc_info=new.error
            )
            return False
        self.engine = new
        self._takes_params = takes_params(new.add_request)
        self._close(engine)
        return True

    def _close(self, engine: StageEngine) -> None:
        if isinstance(engine, ClosableEngine):
            closed = foreign.call(engine.close)
            if isinstance(closed, Raised):  # whatever it raised, the old engine is gone
                log.error("stage %d: engine close() raised", self.stage_id, exc_info=closed.error)

    def _give_all(self, request_ids: Iterable[str]) -> Failures:
        failed = []
        for rid in request_ids:
            error = self._give(rid)
            if error is not None:
                failed.append((rid, error))
        return failed

    def _give(self, request_id: str) -> str | None:
        """Give the engine a request, again if it ran before: its stream from the start,
        and what it sent to be skipped."""
        given = self._given[request_id]
        if given.runs:
            given.skip = given.sent
            if isinstance(given.data, ChunkStream):
                given.data.rewind()
        given.runs += 1
        if self._takes_params:
            add: Any = self.engine.add_request  # declares `params` (checked above)
            added = foreign.call(add, request_id, given.data, params=given.params)
        else:
            added = foreign.call(self.engine.add_request, request_id, given.data)
        if isinstance(added, Raised):  # that request alone fails
            return self.describe("add_request", added.error)
        return None

    def _unsent(self, outputs: list[EngineOutput], failed: Failures) -> list[EngineOutput]:
        """The outputs not sent before: a re-run's first ones were. A re-run that ends
        before it made them all did not re-run alike: its request fails (into `failed`)."""
        fresh = []
        for out in outputs:
            given = self._given.get(out.request_id)
            if given is not None and given.skip and out.error is None:
                if not out.finished:
                    given.skip -= 1
                    continue
                made, sent = given.sent - given.skip + 1, given.sent
                error = f"{self.stage_name} re-run after an engine reset ended after {made} "
                failed.append((out.request_id, error + f"outputs, {sent} already sent"))
                continue
            if given is not None:
                given.sent += 1
            fresh.append(out)
        return fresh
