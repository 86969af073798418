"""How the worker drives stage code: functions and generators on a thread pool, classes as is.

The user's side of this contract (what a stage looks like) is `omni_runtime.stage_api`;
this module is the runtime's side, so stage authors never import it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator
from pathlib import Path
from typing import Any, cast

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised
from omni_runtime.core.types import FinishReason, TokenUsage
from omni_runtime.errors import ConfigError
from omni_runtime.logs import for_request as _rid
from omni_runtime.pipeline import StageConfig, resolve_entry
from omni_runtime.stage_api import (
    MARKS_FINAL_ATTR,
    PRELOAD_ATTR,
    AsyncStageEngine,
    ChunkStream,
    EngineOutput,
    Final,
    RequestAborted,
    StageEngine,
    refusal_code,
    takes_params,
)
from omni_runtime.worker.last_chunk import Emit, LastChunkSink
from omni_runtime.worker.stage_pool import StagePool

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 1.0
"""How long `close` waits for aborted stage code to return before leaving it running."""
QUICK_CALL_S = 0.001
"""A stage whose calls take less than this (a moving average over all of them) runs them
on the thread whose pass starts them, when that thread offers (`defer`): waking a pool
thread would cost more than the call (docs/performance.md). `OMNI_WORKER_QUICK_CALL_MS`."""
Defer = Callable[[Callable[[], None]], bool]


class GeneratorEngine:
    """Runs a plain function or generator stage per request on a bounded thread pool."""

    def __init__(
        self,
        fn: Callable[..., Any],
        options: dict[str, Any],
        max_concurrency: int,
        wake: Callable[[], None],
        ended: Callable[[], None] | None = None,
        defer: Defer | None = None,
        quick_call_s: float = QUICK_CALL_S,
    ) -> None:
        self._fn = fn
        self._defer = defer if quick_call_s > 0 else None
        """Offers to run a call on the calling thread after its pass (`LoopTurn.defer`)."""
        self._quick_call_s = quick_call_s
        self._call_s: float | None = None
        """Moving average of a call's duration (None: none timed yet, so none is quick)."""
        self._marks_final = bool(getattr(fn, MARKS_FINAL_ATTR, False))
        self._takes_params = takes_params(fn)
        self._options = options
        self._wake = wake
        self._ended = ended or wake
        """Called instead of `wake` for a request's last output (the worker runs its pass
        there and then, `LoopTurn`); a generator's earlier chunks only wake the loop, so
        those a fast generator yields meanwhile go out together."""
        self._pool = StagePool(max_concurrency, "stage", self._done)
        self.close_grace_s = CLOSE_GRACE_S
        """How long `close` waits for aborted stage code (a drain past its deadline: none)."""
        self._lock = threading.Condition()
        self._outputs: list[EngineOutput] = []
        self._aborted: set[str] = set()
        self._inputs: dict[str, Any] = {}
        self._params: dict[str, dict[str, Any] | None] = {}
        """Each running request's parameters, for code that declares `params`."""
        self._running = 0
        """Requests whose stage code has not returned yet (on a pool thread or queued)."""

    def add_request(self, request_id: str, data: Any, params: dict[str, Any] | None = None) -> None:
        with self._lock:
            self._aborted.discard(request_id)
            self._inputs[request_id] = data
            self._running += 1
        if self._takes_params:
            self._params[request_id] = params
        defer, avg = self._defer, self._call_s
        if (
            defer is not None
            and avg is not None
            and avg < self._quick_call_s
            # never a stream's call: it waits for chunks, maybe on the thread that would run it
            and not isinstance(data, ChunkStream)
            and defer(lambda: self._run_here(request_id, data))
        ):
            return
        self._pool.submit(self._timed_call, request_id, data)

    def step(self) -> list[EngineOutput]:
        with self._lock:
            out, self._outputs = self._outputs, []
        return out

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._outputs)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborted.add(request_id)
            data = self._inputs.pop(request_id, None)
            self._params.pop(request_id, None)
            self._outputs = [o for o in self._outputs if o.request_id != request_id]
        if isinstance(data, ChunkStream):
            data.abort()

    def close(self) -> None:
        """Abort everything; join the pool if the stage code returns within `close_grace_s`,
        else say how much of it is still running (its threads, daemons, do not hold the
        process)."""
        with self._lock:
            streams = [d for d in self._inputs.values() if isinstance(d, ChunkStream)]
            self._aborted.update(self._inputs)
        for s in streams:
            s.abort()
        self._pool.shutdown()
        deadline = time.monotonic() + self.close_grace_s
        with self._lock:
            self._lock.wait_for(lambda: self._running == 0, deadline - time.monotonic())
            running = self._running
        if running:
            log.warning("stage code still running on %d pool thread(s) after close", running)
        else:
            self._pool.join(max(0.0, deadline - time.monotonic()) + self.close_grace_s)

    # --- on a pool thread ------------------------------------------------------

    def _emit(
        self,
        request_id: str,
        data: Any,
        finished: bool,
        error: str | None = None,
        error_code: str | None = None,
        finish_reason: FinishReason | None = None,
        usage: TokenUsage | None = None,
    ) -> bool:
        """Queue one output; False once the request was aborted (stop producing)."""
        with self._lock:
            if request_id in self._aborted:
                return False
            out = EngineOutput(request_id, data, finished, error, error_code, finish_reason, usage)
            self._outputs.append(out)
            if finished:
                self._inputs.pop(request_id, None)
        (self._ended if finished else self._wake)()
        return True

    def _done(self) -> None:
        """Run, failed or cancelled at shutdown: the request no longer holds a pool thread."""
        with self._lock:
            self._running -= 1
            self._lock.notify_all()

    def _run_here(self, request_id: str, data: Any) -> None:
        """A deferred call, on the thread that started it: as a pool thread would run it."""
        try:
            self._timed_call(request_id, data)
        finally:
            self._done()

    def _timed_call(self, request_id: str, data: Any) -> None:
        started = time.perf_counter()
        self._call(request_id, data)
        took = time.perf_counter() - started
        last = self._call_s  # (a racing update loses one sample: harmless)
        self._call_s = took if last is None else 0.8 * last + 0.2 * took

    def _call(self, request_id: str, data: Any) -> None:
        """Run the stage code for one request; whatever it raises fails that request alone."""
        ran = foreign.call(self._run_stage, request_id, data)
        if isinstance(ran, Raised) and not isinstance(ran.error, RequestAborted):
            code = refusal_code(ran.error)
            if code is not None:  # the request's fault, not the stage's: no traceback
                log.info("request refused (%s): %s", code, ran.error, extra=_rid(request_id))
            else:
                log.error(
                    "stage code failed for %r",
                    request_id,
                    exc_info=ran.error,
                    extra=_rid(request_id),
                )
            self._emit(request_id, None, True, error=ran.describe(), error_code=code)

    def _run_stage(self, request_id: str, data: Any) -> None:
        """The stage function, its coroutine or its generator (sync or async) run out."""
        if self._takes_params:
            params = self._params.pop(request_id, None)
            result = self._fn(data, **self._options, params=params)
        else:
            result = self._fn(data, **self._options)
        if inspect.isasyncgen(result):
            asyncio.run(_collect_async(result, request_id, self._emit, not self._marks_final))
            return
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        if inspect.isgenerator(result):
            self._drain(request_id, result)
        elif isinstance(result, Final):
            self._emit(
                request_id,
                result.data,
                True,
                finish_reason=result.finish_reason,
                usage=result.usage,
            )
        else:
            self._emit(request_id, result, True)

    def _drain(self, request_id: str, gen: Generator[Any, Any, Any]) -> None:
        """Emit each chunk, holding one back unless the code marks its last with `Final`."""
        sink = LastChunkSink(request_id, self._emit, hold=not self._marks_final)
        try:
            for item in gen:
                if not sink.push(item):
                    return
        finally:
            gen.close()
        sink.end()


async def _collect_async(
    agen: AsyncGenerator[Any, Any], request_id: str, emit: Emit, hold: bool
) -> None:
    sink = LastChunkSink(request_id, emit, hold)
    try:
        async for item in agen:
            if not sink.push(item):
                return
    finally:
        await agen.aclose()
    sink.end()


def engine_factory(stage: StageConfig, source_dir: Path | None) -> Callable[[], StageEngine] | None:
    """How to build a step engine anew (`cls(**options)`), so the worker can start it over
    after a failed step; None for any other stage (a function's calls do not fail as a
    batch; another engine shape is wrapped, and not rebuilt this way)."""
    entry = resolve_entry(stage.entry, source_dir)
    if not (inspect.isclass(entry) and issubclass(entry, StageEngine)):
        return None
    return cast("Callable[[], StageEngine]", functools.partial(entry, **stage.options))


def load_engine(
    stage: StageConfig,
    source_dir: Path | None,
    max_concurrency: int,
    wake: Callable[[], None],
    ended: Callable[[], None] | None = None,
    defer: Defer | None = None,
    quick_call_s: float = QUICK_CALL_S,
    *,
    on_dead: Callable[[str], None] | None = None,
    start_timeout_s: float | None = None,
    health_interval_s: float | None = None,
) -> StageEngine:
    """A class entry is a step engine (`cls(**options)`), or an async engine wrapped in an
    `AsyncEngineDriver` (`on_dead`, `start_timeout_s`, `health_interval_s`: see it; its
    `start()` is the caller's); a callable is wrapped (`wake`, `ended`, `defer` and
    `quick_call_s`: see `GeneratorEngine`)."""
    entry = resolve_entry(stage.entry, source_dir)
    if inspect.isclass(entry):
        engine = entry(**stage.options)
        if isinstance(engine, StageEngine):
            return engine
        if isinstance(engine, AsyncStageEngine):
            from omni_runtime.worker import async_engine  # it builds on this module

            timing = {
                "start_timeout_s": start_timeout_s or async_engine.START_TIMEOUT_S,
                "health_interval_s": health_interval_s or async_engine.HEALTH_INTERVAL_S,
            }
            return async_engine.AsyncEngineDriver(
                engine, stage.name, wake, ended, on_dead=on_dead, **timing
            )
        raise ConfigError(
            f"stage {stage.id} entry {stage.entry!r} is a class but neither a StageEngine "
            "(add_request, step, abort, has_work) nor an AsyncStageEngine (start, generate, "
            "abort, check_health, stats, close)"
        )
    preload = getattr(entry, PRELOAD_ATTR, None)
    if preload is not None:
        preload(dict(stage.options))
    return GeneratorEngine(entry, stage.options, max_concurrency, wake, ended, defer, quick_call_s)
