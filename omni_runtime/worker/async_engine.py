"""An `AsyncStageEngine` driven as a step engine: the worker's loop sees `add_request`,
`step`, `abort`, `has_work`, `close`, and the engine gets one event loop of its own.

The loop runs on a thread of this driver (started by `start`, never by the constructor).
Each request is one task that iterates the engine's `generate` and queues its items as
`EngineOutput`s, holding one back to mark the last one finished unless the item is
`Final(x)` (or `generate` is `@marks_final`), as a generator stage's are. An exception
from `generate` fails that request alone. `check_health` runs every
`OMNI_ENGINE_HEALTH_INTERVAL_S`; a check that raises or does not return within it, or an
`EngineDead` from `generate`, makes the engine dead: the driver then drops every output
and calls `on_dead` (the worker process leaves service, and its inputs are taken over by
another replica), or, without one, fails every request it holds and any it is given.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised
from omni_runtime.core.types import FinishReason, TokenUsage
from omni_runtime.errors import StartupTimeoutError
from omni_runtime.logs import for_request as _rid
from omni_runtime.stage_api import (
    MARKS_FINAL_ATTR,
    AsyncStageEngine,
    ChunkStream,
    EngineDead,
    EngineOutput,
    EngineStats,
    RequestAborted,
    refusal_code,
)
from omni_runtime.worker.last_chunk import LastChunkSink

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""Longest `engine.start()` (a model load): `OMNI_ENGINE_START_TIMEOUT_S`."""
HEALTH_INTERVAL_S = 5.0
"""How often `check_health` runs, and how long it may take: `OMNI_ENGINE_HEALTH_INTERVAL_S`."""
CLOSE_TIMEOUT_S = 10.0
"""How long `close` waits for the engine's `close()` before leaving it."""


class AsyncEngineDriver:
    """Makes an `AsyncStageEngine` look like a step engine to the worker (module docstring)."""

    def __init__(
        self,
        engine: AsyncStageEngine,
        name: str,
        wake: Callable[[], None],
        ended: Callable[[], None] | None = None,
        *,
        on_dead: Callable[[str], None] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        health_interval_s: float = HEALTH_INTERVAL_S,
    ) -> None:
        self.engine = engine
        self.name = name
        self._wake = wake
        self._ended = ended or wake
        self._on_dead = on_dead
        self._start_timeout_s = start_timeout_s
        self._health_interval_s = health_interval_s
        self._hold = not getattr(engine.generate, MARKS_FINAL_ATTR, False)
        self._lock = threading.Lock()
        self._outputs: list[EngineOutput] = []
        self._live: set[str] = set()
        """Requests whose outputs are still wanted (added, not finished, failed or aborted)."""
        self._dead: str | None = None
        """Why the engine is dead; None while it serves."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # On the loop's thread only:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._streams: dict[str, ChunkStream] = {}
        """Streamed inputs of running requests: an abort ends their iteration anywhere."""
        self._health: asyncio.Task[None] | None = None

    # --- the worker's side (its loop thread) ----------------------------------------

    def start(self) -> None:
        """Start the event loop's thread, then the engine, within `start_timeout_s`."""
        loop = self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run_loop, args=(loop,), name=f"engine-{self.name}", daemon=True
        )
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._start_engine(), loop)
        ok = False
        try:  # the loop enforces the deadline; this wait only backs it up
            started.result(self._start_timeout_s + 5)
            ok = True
        except (TimeoutError, concurrent.futures.TimeoutError):
            raise StartupTimeoutError(
                f"engine {self.name} did not start within {self._start_timeout_s:g}s "
                "(OMNI_ENGINE_START_TIMEOUT_S)"
            ) from None
        finally:
            if not ok:  # a failed start leaves no thread; what the engine loaded is released
                self.close()
        log.info("engine %s started", self.name)

    def add_request(self, request_id: str, data: Any, params: dict[str, Any] | None = None) -> None:
        loop = self._loop
        if loop is None:
            raise RuntimeError(f"engine {self.name}: add_request before start()")
        with self._lock:
            dead = self._dead
            if dead is None:
                self._live.add(request_id)
        if dead is not None:
            if self._on_dead is None:  # fail fast; with `on_dead` the input waits for takeover
                self._queue(EngineOutput(request_id, None, True, f"engine dead: {dead}"))
            return
        loop.call_soon_threadsafe(self._begin, request_id, data, params)

    def step(self) -> list[EngineOutput]:
        with self._lock:
            out, self._outputs = self._outputs, []
        return out

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._outputs)

    def abort(self, request_id: str) -> None:
        """Drop the request's outputs; on the loop: cancel its task, then `engine.abort`."""
        with self._lock:
            self._live.discard(request_id)
            if self._outputs:
                self._outputs = [o for o in self._outputs if o.request_id != request_id]
        loop = self._loop
        if loop is not None and not self._closed:
            with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile (close)
                loop.call_soon_threadsafe(self._cancel, request_id)

    def stats(self) -> EngineStats:
        """The engine's own count (any thread: the metrics scrape, the heartbeat)."""
        return self.engine.stats()

    @property
    def dead(self) -> str | None:
        """Why the engine is dead, or None."""
        with self._lock:
            return self._dead

    def close(self) -> None:
        """Cancel every request, `engine.close()` (bounded), stop the loop. Idempotent."""
        loop = self._loop
        if self._closed or loop is None:
            self._closed = True
            return
        self._closed = True
        with self._lock:
            self._live.clear()
        closing = asyncio.run_coroutine_threadsafe(self._close_engine(), loop)
        try:  # what the engine's close() raised is logged on the loop (`_close_engine`)
            closing.result(CLOSE_TIMEOUT_S)
        except (TimeoutError, concurrent.futures.TimeoutError):
            log.warning("engine %s close() did not return within %gs", self.name, CLOSE_TIMEOUT_S)
        except concurrent.futures.CancelledError:
            log.warning("engine %s close() was cancelled", self.name)
        self._stop_loop()

    # --- on the event loop's thread -------------------------------------------------

    def _run_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:  # what is still running ends here, cancelled, not destroyed pending
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_TIMEOUT_S)
        self._loop = None

    async def _start_engine(self) -> None:
        try:
            await asyncio.wait_for(self.engine.start(), self._start_timeout_s)
        except TimeoutError:
            raise StartupTimeoutError(
                f"engine {self.name} did not start within {self._start_timeout_s:g}s "
                "(OMNI_ENGINE_START_TIMEOUT_S)"
            ) from None
        self._health = asyncio.create_task(self._watch_health())

    async def _close_engine(self) -> None:
        if self._health is not None:
            self._health.cancel()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        closed = await foreign.acall(self.engine.close)
        if isinstance(closed, Raised):  # whatever it raised, the loop stops
            log.error("engine %s close() raised", self.name, exc_info=closed.error)

    def _begin(self, request_id: str, data: Any, params: dict[str, Any] | None) -> None:
        with self._lock:
            if request_id not in self._live:  # aborted before its task started
                return
        if isinstance(data, ChunkStream):
            self._streams[request_id] = data
        task = asyncio.get_running_loop().create_task(self._serve(request_id, data, params))
        self._tasks[request_id] = task

    async def _serve(self, request_id: str, data: Any, params: dict[str, Any] | None) -> None:
        """One request: iterate `generate`, queue its outputs; its errors end it alone."""
        sink = LastChunkSink(request_id, self._emit, hold=self._hold)
        outputs = self.engine.generate(request_id, data, params)
        try:
            served = await foreign.acall(self._iterate, outputs, sink)
            if isinstance(served, Raised):
                self._generate_failed(request_id, served.error)
        except asyncio.CancelledError:
            pass  # aborted: the request wants nothing more
        finally:
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:  # what it raises, cancelled or not, changes nothing now
                with contextlib.suppress(asyncio.CancelledError):
                    await foreign.acall(aclose)
            if self._tasks.get(request_id) is asyncio.current_task():
                del self._tasks[request_id]
                self._streams.pop(request_id, None)

    @staticmethod
    async def _iterate(outputs: Any, sink: LastChunkSink) -> None:
        async for item in outputs:
            if not sink.push(item):
                return
        sink.end()

    def _generate_failed(self, request_id: str, e: Exception) -> None:
        """`RequestAborted`: nothing more is wanted; `EngineDead`: the engine is; anything
        else fails this request alone."""
        if isinstance(e, RequestAborted):
            return
        if isinstance(e, EngineDead):
            self._died(f"generate({request_id!r}) raised EngineDead: {e}")
            return
        code = refusal_code(e)
        if code is not None:  # the request's fault, not the engine's: no traceback
            log.info("request refused (%s): %s", code, e, extra=_rid(request_id))
        else:
            log.error("engine %s failed request", self.name, exc_info=e, extra=_rid(request_id))
        error = f"{self.name} generate() raised {type(e).__name__}: {e}"
        self._emit(request_id, None, True, error, code)

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
        """Queue one output; False once the request is not wanted (aborted, engine dead)."""
        with self._lock:
            if request_id not in self._live:
                return False
            out = EngineOutput(request_id, data, finished, error, error_code, finish_reason, usage)
            self._outputs.append(out)
            if finished:
                self._live.discard(request_id)
        (self._ended if finished else self._wake)()
        return True

    def _queue(self, output: EngineOutput) -> None:
        with self._lock:
            self._outputs.append(output)
        self._ended()

    def _cancel(self, request_id: str) -> None:
        """Stop the request's iteration (and its input's, which the engine may read on a
        task of its own), then tell the engine."""
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.abort()
        asyncio.get_running_loop().create_task(self._abort_engine(request_id))

    async def _abort_engine(self, request_id: str) -> None:
        aborted = await foreign.acall(self.engine.abort, request_id)
        if isinstance(aborted, Raised):  # the request is dropped all the same
            log.error(
                "engine %s abort() raised",
                self.name,
                exc_info=aborted.error,
                extra=_rid(request_id),
            )

    async def _watch_health(self) -> None:
        interval = self._health_interval_s
        while True:
            await asyncio.sleep(interval)
            checked = await foreign.acall(
                lambda: asyncio.wait_for(self.engine.check_health(), interval)
            )
            if not isinstance(checked, Raised):
                continue
            if isinstance(checked.error, TimeoutError):
                reason = f"check_health() did not return within {interval:g}s"
            else:  # any failure is unhealthy
                reason = f"check_health() raised {checked.describe()}"
            self._died(f"{reason} (checked every OMNI_ENGINE_HEALTH_INTERVAL_S={interval:g})")
            return

    def _died(self, reason: str) -> None:
        """The engine can serve nothing more: stop every request, tell the worker (once)."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
            live = sorted(self._live)
            self._live.clear()
            self._outputs.clear()
        for task in self._tasks.values():
            if task is not asyncio.current_task():
                task.cancel()
        if self._health is not None and self._health is not asyncio.current_task():
            self._health.cancel()
        log.error("engine %s is dead (%d request(s) held): %s", self.name, len(live), reason)
        if self._on_dead is not None:
            self._on_dead(reason)
            return
        for rid in live:
            self._queue(EngineOutput(rid, None, True, f"engine dead: {reason}"))
