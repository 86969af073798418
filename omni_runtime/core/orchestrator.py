"""The central router of a pipeline (SPEC §3): sequential mode.

Three queues and three kinds of task (plus one for deadlines). Request state
changes in the handler (add, abort), the deadline task (abort) and the
dispatcher (outputs), each time completely before its next await, so an output
handled while a `submit` is in flight always sees a consistent `ReqState`. The
same class runs in-process (`InMemoryStage`) and in the orchestrator process
(Redis stage clients).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from omni_runtime.core.deadlines import Deadlines
from omni_runtime.core.types import (
    CounterSink,
    ForwardFn,
    ManagedStage,
    OrchOutput,
    ReqState,
    Stage,
    StageFailure,
    StageOutput,
    forward_previous_data,
)

log = logging.getLogger(__name__)


class Orchestrator:
    """Routes every stage's outputs: forward to the next stage, emit to the user, clean up."""

    def __init__(
        self,
        stages: Sequence[Stage],
        final_stage_ids: Iterable[int],
        forward_fn: ForwardFn = forward_previous_data,
        default_deadline_s: float | None = None,
        metrics: CounterSink | None = None,
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
        self.forward_fn = forward_fn
        self.default_deadline_s = default_deadline_s
        self.request_states: dict[str, ReqState] = {}
        self.dropped_outputs: int = 0
        self._req_q: asyncio.Queue[tuple[str, str, Any]] = asyncio.Queue()
        self._ready_q: asyncio.Queue[tuple[int, StageOutput]] = asyncio.Queue()
        self._out_q: asyncio.Queue[OrchOutput] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._deadline_s: dict[str, float] = {}
        """Per-request deadline overrides, read once by the handler."""
        self._deadlines = Deadlines()
        self._deadline_added = asyncio.Event()

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
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> Orchestrator:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.shutdown()

    # --- public API ------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt: Any, deadline_s: float | None = None
    ) -> None:
        """Only enqueue: the handler task creates the state and submits to stage 0.

        Past `deadline_s` (default: `default_deadline_s`) the request ends with an
        error output and is aborted at every stage.
        """
        if deadline_s is not None:
            self._deadline_s[request_id] = deadline_s
        await self._req_q.put(("add", request_id, prompt))

    async def abort_request(self, request_id: str, reason: str = "aborted") -> None:
        """End a live request with one error output and abort it at every stage that has it.

        A request that already ended is left alone: it got its one final output.
        """
        await self._req_q.put(("abort", request_id, reason))

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
            if kind == "add":
                await self._handle_add(request_id, payload)
            else:
                await self._handle_abort(request_id, payload)

    async def _deadline_loop(self) -> None:
        """Sleeps until the earliest deadline; a request still live then is aborted."""
        loop = asyncio.get_running_loop()
        while True:
            self._deadline_added.clear()
            request_id = self._deadlines.pop_due(loop.time())
            if request_id is not None:
                await self._handle_abort(request_id, "deadline exceeded")
                continue
            at = self._deadlines.next_at()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if at is None else at - loop.time()):
                    await self._deadline_added.wait()

    async def _reader_loop(self, stage_id: int) -> None:
        """One reader per stage → one FIFO → one dispatcher keeps each stage's order."""
        stage = self.stages[stage_id]
        while True:
            outputs = await stage.get_output()
            for out in outputs:
                self._ready_q.put_nowait((stage_id, out))

    async def _dispatcher_loop(self) -> None:
        while True:
            stage_id, out = await self._ready_q.get()
            await self._handle_output(stage_id, out)
            managed = self._managed[stage_id]
            if managed is not None:  # a durable stage acknowledges only what was handled
                managed.output_handled(out)

    # --- routing ---------------------------------------------------------------

    async def _handle_add(self, request_id: str, prompt: Any) -> None:
        state = await self._register_or_reject(request_id, prompt)
        if state is None:
            return
        state.submitted.add(0)
        await self._submit(request_id, 0, prompt)

    async def _register_or_reject(self, request_id: str, prompt: Any) -> ReqState | None:
        """Register the request; a duplicate id gets one error output and None."""
        state = self._register(request_id, prompt)
        if state is None:
            await self._out_q.put(
                OrchOutput(request_id, 0, None, True, error="duplicate request id")
            )
        return state

    def _register(self, request_id: str, prompt: Any) -> ReqState | None:
        """Create and register the state (no await here); None for a duplicate id."""
        deadline_s = self._deadline_s.pop(request_id, self.default_deadline_s)
        if request_id in self.request_states:
            return None
        state = ReqState(prompt=prompt)
        self.request_states[request_id] = state
        if deadline_s is not None:
            self._deadlines.add(request_id, asyncio.get_running_loop().time() + deadline_s)
            self._deadline_added.set()
        return state

    async def _handle_abort(self, request_id: str, reason: str) -> None:
        state = self.request_states.get(request_id)
        if state is None:
            return  # already ended (or never added): it had, or will have, its one output
        self._cleanup(request_id)
        stage_id = max(state.submitted, default=0)
        await self._out_q.put(OrchOutput(request_id, stage_id, None, True, error=reason))
        await self._abort_stages(request_id, state.submitted - state.finished)

    async def _abort_stages(self, request_id: str, stage_ids: set[int]) -> None:
        """Tell every stage that may still hold the request to drop it."""
        for sid in sorted(stage_ids):
            managed = self._managed[sid]
            if managed is None:
                continue
            try:
                await managed.abort(request_id)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning(
                    "stage %d could not abort: %r", sid, e, extra={"request_id": request_id}
                )

    async def _record(self, stage_id: int, out: StageOutput) -> ReqState | None:
        """Steps 1-3: drop and count an unknown request's output (never resurrect state) or a
        stage's second `finished`, end the request on a stage failure, else record the
        data. None: nothing more to do."""
        state = self.request_states.get(out.request_id)
        if state is None:  # late, or never added
            self._drop(stage_id, out)
            managed = self._managed[stage_id]
            if managed is not None:
                managed.request_ended(out.request_id)
            return None
        if out.finished and stage_id in state.finished:  # a repeat: the stage already ended
            self._drop(stage_id, out)
            return None
        if isinstance(out.data, StageFailure):
            await self._fail(out.request_id, stage_id, out.data.error)
            return None
        state.stage_data.setdefault(stage_id, []).append(out.data)
        if out.finished:
            state.finished.add(stage_id)
        return state

    async def _handle_output(self, stage_id: int, out: StageOutput) -> None:
        rid = out.request_id
        state = await self._record(stage_id, out)
        if state is None:
            return
        if stage_id in self.final_stage_ids and await self._emit_final(rid, stage_id, state, out):
            return
        if out.finished and stage_id < self.last_stage:
            nxt = stage_id + 1
            next_input = self.forward_fn(nxt, state.prompt, state.stage_data[stage_id])
            state.submitted.add(nxt)
            await self._submit(rid, nxt, next_input)

    async def _emit_final(self, rid: str, stage_id: int, state: ReqState, out: StageOutput) -> bool:
        """Step 4: emit a final stage's output; True if that ended the request (cleaned up)."""
        done = self.final_stage_ids <= state.finished
        if done:
            self._cleanup(rid)
        await self._out_q.put(OrchOutput(rid, stage_id, out.data, done))
        return done

    async def _submit(self, request_id: str, stage_id: int, data: Any) -> None:
        """Submit; a failing stage ends this request alone with one error output."""
        try:
            await self.stages[stage_id].submit(request_id, data)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("stage %d submit failed: %r", stage_id, e, extra={"request_id": request_id})
            if request_id in self.request_states:
                await self._fail(
                    request_id, stage_id, f"stage {stage_id} submit failed: {type(e).__name__}: {e}"
                )

    async def _fail(self, request_id: str, stage_id: int, error: str) -> None:
        """End one request with exactly one error output; every other request goes on.

        Stages that still hold the request (streaming mode starts them all) are aborted.
        """
        state = self.request_states.get(request_id)
        self._cleanup(request_id)
        await self._out_q.put(OrchOutput(request_id, stage_id, None, True, error=error))
        if state is not None:
            await self._abort_stages(request_id, state.submitted - {stage_id} - state.finished)

    def _drop(self, stage_id: int, out: StageOutput) -> None:
        log.debug("output of stage %d dropped", stage_id, extra={"request_id": out.request_id})
        self.dropped_outputs += 1
        if self.metrics is not None:
            self.metrics.inc("omni_dropped_outputs_total", stage=stage_id)

    def _cleanup(self, request_id: str) -> None:
        """Forget the request; later outputs for it are dropped and counted."""
        self.request_states.pop(request_id, None)
        self._deadlines.cancel(request_id)
        for managed in self._managed:
            if managed is not None:
                managed.request_ended(request_id)
