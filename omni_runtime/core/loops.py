"""The orchestrator's tasks and public API (SPEC §3), apart from its routing rules.

`Orchestrator` (routing, `core/orchestrator.py`) builds on this: three queues and
three kinds of task (plus one for deadlines). Two optional hooks serve a process
that keeps request state durable (`Hooks`, given at construction): `sink` takes each user output synchronously (so
the state change and the output it causes reach the shell in one step, with no
await between), `on_change` hears which request's state changed (None: it ended),
`step_done` hears that the adds (or outputs) queued so far are all handled.
`restore_request` registers a state saved earlier without submitting anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from omni_runtime.core import foreign
from omni_runtime.core.deadlines import Deadlines
from omni_runtime.core.foreign import Raised
from omni_runtime.core.tasks import cancel_and_wait
from omni_runtime.core.types import (
    CounterSink,
    ForwardFn,
    ManagedStage,
    OrchOutput,
    ReqState,
    Stage,
    StageOutput,
    forward_previous_data,
    request_finals,
)

log = logging.getLogger(__name__)

READ_RETRY_S = 0.1
"""A stage reader that raised tries again after this long (a Redis error is retried inside)."""

OutputSink = Callable[[OrchOutput], None]
ChangeHook = Callable[[str, ReqState | None], None]


@dataclass(frozen=True, slots=True)
class Hooks:
    """What a shell that keeps request state durable hears from the core, given whole at
    construction (the module docstring says when each is called)."""

    sink: OutputSink | None = None
    """Set: every user output goes here at once instead of `next_output`'s queue."""
    on_change: ChangeHook | None = None
    step_done: Callable[[], None] | None = None
    """Called once the adds (or the outputs) queued so far are handled: the state is
    whole again, so a shell batching its writes may send what they queued at once, in
    one batch (one per output of a burst would make the rest wait a round trip)."""


class OrchestratorLoops:
    """State, queues, tasks and the public API; subclasses supply the `_handle_*` methods."""

    def __init__(
        self,
        stages: Sequence[Stage],
        final_stage_ids: Iterable[int],
        forward_fn: ForwardFn = forward_previous_data,
        default_deadline_s: float | None = None,
        metrics: CounterSink | None = None,
        hooks: Hooks | None = None,
        audio_stage: int | None = None,
    ) -> None:
        self.stages: list[Stage] = list(stages)
        self._managed: list[ManagedStage | None] = [
            s if isinstance(s, ManagedStage) else None for s in self.stages
        ]  # the stages that take acks, aborts and request ends
        self.metrics = metrics
        self.final_stage_ids: frozenset[int] = frozenset(final_stage_ids)
        if not self.final_stage_ids:
            raise ValueError("final_stage_ids must name at least one stage")
        bad = sorted(s for s in self.final_stage_ids if not 0 <= s < len(self.stages))
        if bad:
            raise ValueError(f"final stage ids {bad} outside 0..{len(self.stages) - 1}")
        self.last_stage: int = max(self.final_stage_ids)
        self.audio_stage = audio_stage
        """The final stage that speaks: a request that wants no audio ends before it."""
        self.forward_fn = forward_fn
        self.default_deadline_s = default_deadline_s
        self.request_states: dict[str, ReqState] = {}
        self.dropped_outputs: int = 0
        hooks = hooks or Hooks()
        self.sink, self.on_change, self.step_done = hooks.sink, hooks.on_change, hooks.step_done
        self._req_q: asyncio.Queue[tuple[str, str, Any]] = asyncio.Queue()
        self._ready_q: asyncio.Queue[tuple[int, StageOutput]] = asyncio.Queue()
        self._out_q: asyncio.Queue[OrchOutput] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._deadline_s: dict[str, float] = {}
        """Per-request deadline overrides, read once by the handler."""
        self._deadlines = Deadlines()
        self._deadline_added = asyncio.Event()
        self._answered: set[str] = set()
        """Requests whose final went out during the step in progress (see `_contain`)."""

    # --- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Start the handler, one reader per stage up to the last final one, the dispatcher."""
        if self._tasks:
            raise RuntimeError("orchestrator already started")
        self._tasks.append(asyncio.create_task(self._handler_loop(), name="orch-handler"))
        for sid in range(self.last_stage + 1):
            self._tasks.append(
                asyncio.create_task(self._reader_loop(sid), name=f"orch-reader-{sid}")
            )
        self._tasks.append(asyncio.create_task(self._dispatcher_loop(), name="orch-dispatcher"))
        self._tasks.append(asyncio.create_task(self._deadline_loop(), name="orch-deadlines"))

    async def shutdown(self) -> None:
        """Cancel every task and wait for them, so none is destroyed while pending."""
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)

    # --- public API ------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        deadline_s: float | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        """Only enqueue: the handler task creates the state and submits to stage 0.

        Past `deadline_s` (default: `default_deadline_s`) the request ends with an
        error output and is aborted at every stage.
        """
        if deadline_s is not None:
            if not math.isfinite(deadline_s):  # NaN would break the deadline heap's order
                raise ValueError(f"deadline_s must be a finite number of seconds, not {deadline_s}")
            self._deadline_s[request_id] = deadline_s
        await self._req_q.put(("add", request_id, (prompt, params)))

    async def abort_request(self, request_id: str, reason: str = "aborted") -> None:
        """End a live request with one error output and abort it at every stage that has it.

        A request that already ended is left alone: it got its one final output.
        """
        self.abort_soon(request_id, reason)

    def abort_soon(self, request_id: str, reason: str = "aborted") -> None:
        """`abort_request` from synchronous code (a writer that gave up on its writes)."""
        self._req_q.put_nowait(("abort", request_id, reason))

    def fail_soon(self, request_id: str, error: str) -> None:
        """`abort_request` from synchronous code: the handler ends the request (if live)
        with one error output, `error`."""
        self._req_q.put_nowait(("abort", request_id, error))

    def restore_request(self, request_id: str, state: ReqState, deadline_s: float | None) -> bool:
        """Take over a request routed before (its state saved elsewhere): registered as is,
        nothing submitted again; its outputs are routed from here on. `deadline_s` is what
        is left of its deadline (≤ 0: it ends at once). False if the id is live already."""
        if request_id in self.request_states:
            return False
        state.finals = request_finals(self.final_stage_ids, self.audio_stage, state.params)
        state.last_stage = max(state.finals)
        self.request_states[request_id] = state
        if deadline_s is not None:
            self._deadlines.add(request_id, asyncio.get_running_loop().time() + deadline_s)
            self._deadline_added.set()
        return True

    async def next_output(self, timeout: float | None = None) -> OrchOutput:
        """The next output for the user; raises `TimeoutError` after `timeout` seconds."""
        if timeout is None:
            return await self._out_q.get()
        async with asyncio.timeout(timeout):
            return await self._out_q.get()

    # --- loops -----------------------------------------------------------------

    async def _handler_loop(self) -> None:
        while True:
            kind, request_id, payload = await self._req_q.get()
            self._answered.clear()
            live = request_id in self.request_states
            try:
                if kind == "add":
                    prompt, params = payload
                    await self._handle_add(request_id, prompt, params)
                else:
                    await self._handle_abort(request_id, payload)
            except Exception as e:  # as `_contained`, inline: this runs once per request
                needs_final = not live if kind == "add" else live
                await self._contain(f"handling its {kind}", request_id, needs_final, e)
            if kind == "add" and self._req_q.empty():
                self._step_done()

    async def _deadline_loop(self) -> None:
        """Sleeps until the earliest deadline; a request still live then is aborted."""
        loop = asyncio.get_running_loop()
        while True:
            self._deadline_added.clear()
            request_id = self._deadlines.pop_due(loop.time())
            if request_id is not None:
                self._answered.clear()
                await self._contained(
                    "ending it at its deadline",
                    request_id,
                    True,
                    functools.partial(self._handle_abort, request_id, "deadline exceeded"),
                )
                continue
            at = self._deadlines.next_at()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if at is None else at - loop.time()):
                    await self._deadline_added.wait()

    async def _reader_loop(self, stage_id: int) -> None:
        """One reader per stage → one FIFO → one dispatcher keeps each stage's order."""
        stage = self.stages[stage_id]
        while True:
            outputs = await foreign.acall(stage.get_output)  # a stage is duck-typed (SPEC §2)
            if isinstance(outputs, Raised):  # a reader that stopped would stall every request
                self._count_contained(f"reading stage {stage_id}")
                log.error(
                    "stage %d: reading outputs failed: %r",
                    stage_id,
                    outputs.error,
                    exc_info=outputs.error,
                )
                await asyncio.sleep(READ_RETRY_S)
                continue
            for out in outputs:
                self._ready_q.put_nowait((stage_id, out))

    async def _dispatcher_loop(self) -> None:
        while True:
            stage_id, out = await self._ready_q.get()
            self._answered.clear()
            live = out.request_id in self.request_states
            try:
                await self._handle_output(stage_id, out)
            except Exception as e:  # as `_contained`, inline: this runs once per output
                await self._contain(f"routing a stage {stage_id} output", out.request_id, live, e)
            managed = self._managed[stage_id]
            if managed is not None:  # a durable stage acknowledges only what was handled
                managed.output_handled(out)
            if self._ready_q.empty():
                self._step_done()

    def _step_done(self) -> None:
        if self.step_done is None:
            return
        done = foreign.call(self.step_done)  # the shell's hook
        if isinstance(done, Raised):  # the writer task sends what it left
            self._count_contained("step_done")
            log.error("step_done failed: %r", done.error, exc_info=done.error)

    def _count_contained(self, where: str) -> None:
        if self.metrics is not None:
            self.metrics.inc("omni_contained_errors_total", where=where)

    async def _contained(
        self,
        what: str,
        request_id: str,
        needs_final: bool,
        handle: Callable[[], Awaitable[None]],
    ) -> None:
        """Handle one request: whatever that raises ends this request alone (`_contain`)."""
        try:
            await handle()
        except Exception as e:  # a request's handling runs stage code, `forward_fn` and the
            # shell's hooks, which may raise anything: it fails that request alone
            await self._contain(what, request_id, needs_final, e)

    async def _contain(self, what: str, request_id: str, needs_final: bool, e: Exception) -> None:
        """One request's handling raised: it ends with one error final (unless it has had
        one: `needs_final` False, or one went out during this step), and the loop goes on.
        Logged with the request id, counted. Ending it may fail too: that is logged and
        counted in turn (`needs_final` False: no third try)."""
        self._count_contained(what)
        log.error(
            "request failed while %s: %r", what, e, exc_info=e, extra={"request_id": request_id}
        )
        if needs_final and request_id not in self._answered:
            error = f"internal error: {type(e).__name__}: {e}"
            end = functools.partial(self._end_with_error, request_id, error)
            await self._contained("ending a failed request", request_id, False, end)

    # --- hooks -----------------------------------------------------------------

    def _emit(self, out: OrchOutput) -> None:
        """A user output: to the sink, or onto the (unbounded) queue; never an await."""
        if self.sink is not None:
            self.sink(out)
        else:
            self._out_q.put_nowait(out)
        if out.finished:
            self._answered.add(out.request_id)

    def _changed(self, request_id: str, state: ReqState | None) -> None:
        if self.on_change is not None:
            self.on_change(request_id, state)

    async def _handle_add(
        self, request_id: str, prompt: Any, params: dict[str, Any] | None = None
    ) -> None:
        raise NotImplementedError

    async def _handle_abort(self, request_id: str, reason: str) -> None:
        raise NotImplementedError

    async def _handle_output(self, stage_id: int, out: StageOutput) -> None:
        raise NotImplementedError

    async def _end_with_error(self, request_id: str, error: str) -> None:
        raise NotImplementedError
