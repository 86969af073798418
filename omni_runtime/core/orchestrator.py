"""The central router of a pipeline (SPEC §3), in both modes.

Three queues and three kinds of task (plus one for deadlines, `core/loops.py`). Request
state changes in the handler (add, abort), the deadline task (abort) and the dispatcher
(outputs), each time completely before its next await, so an output handled while a
`submit` is in flight always sees a consistent `ReqState`. The same classes run
in-process (`InMemoryStage`) and in the orchestrator process (Redis stage clients).

`Orchestrator` is sequential mode: a stage starts once the one before it finished, on its
data. `StreamingOrchestrator` ("async chunk" mode) starts every stage at once, each reading
its input as chunks: it still sees every stage's outputs, to emit the final stages' and to
know when a request is done, but forwards nothing (stage n+1 consumes stage n's chunks
straight from the data plane, the ChunkAdapter). Only `_handle_add` and `_handle_output`
differ. In both, a request runs the stages up to the last of its own final stages
(`ReqState.finals`): one that wants no audio stops before the pipeline's audio stage.
"""

from __future__ import annotations

import logging
from typing import Any

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised
from omni_runtime.core.loops import OrchestratorLoops
from omni_runtime.core.types import OrchOutput, ReqState, StageFailure, StageOutput

log = logging.getLogger(__name__)


class Orchestrator(OrchestratorLoops):
    """Routes every stage's outputs: forward to the next stage, emit to the user, clean up."""

    async def __aenter__(self) -> Orchestrator:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.shutdown()

    # --- routing ---------------------------------------------------------------

    async def _handle_add(
        self, request_id: str, prompt: Any, params: dict[str, Any] | None = None
    ) -> None:
        state = await self._register_or_reject(request_id, prompt, params)
        if state is None:
            return
        state.submitted.add(0)
        await self._submit(request_id, 0, prompt)

    async def _register_or_reject(
        self, request_id: str, prompt: Any, params: dict[str, Any] | None = None
    ) -> ReqState | None:
        """Register the request; a duplicate id gets one error output and None."""
        state = self._register(request_id, prompt, params)
        if state is None:
            self._emit(OrchOutput(request_id, 0, None, True, error="duplicate request id"))
        return state

    def _register(
        self, request_id: str, prompt: Any, params: dict[str, Any] | None = None
    ) -> ReqState | None:
        """Create and register the state (no await here); None for a duplicate id."""
        deadline_s = self._deadline_s.pop(request_id, self.default_deadline_s)
        if request_id in self.request_states:
            return None
        state = ReqState(prompt=prompt, params=params)
        self.restore_request(request_id, state, deadline_s)
        self._changed(request_id, state)
        return state

    async def _handle_abort(self, request_id: str, reason: str) -> None:
        state = self.request_states.get(request_id)
        if state is None:
            return  # already ended (or never added): it had, or will have, its one output
        self._cleanup(request_id)
        stage_id = max(state.submitted, default=0)
        self._emit(OrchOutput(request_id, stage_id, None, True, error=reason))
        await self._abort_stages(request_id, state.submitted - state.finished)

    async def _abort_stages(self, request_id: str, stage_ids: set[int]) -> None:
        """Tell every stage that may still hold the request to drop it."""
        for sid in sorted(stage_ids):
            managed = self._managed[sid]
            if managed is None:
                continue
            aborted = await foreign.acall(managed.abort, request_id)  # the stage's code
            if isinstance(aborted, Raised):  # logged; the request still ends
                log.warning(
                    "stage %d could not abort: %r",
                    sid,
                    aborted.error,
                    extra={"request_id": request_id},
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
            await self._fail(out.request_id, stage_id, out.data.error, out.data.code)
            return None
        state.stage_data.setdefault(stage_id, []).append(out.data)
        if out.finished:
            state.finished.add(stage_id)
        self._changed(out.request_id, state)
        return state

    async def _handle_output(self, stage_id: int, out: StageOutput) -> None:
        rid = out.request_id
        state = await self._record(stage_id, out)
        if state is None:
            return
        if stage_id in state.finals and await self._emit_final(rid, stage_id, state, out):
            return
        if out.finished and stage_id < state.last_stage:
            nxt = stage_id + 1
            next_input = self.forward_fn(nxt, state.prompt, state.stage_data[stage_id])
            state.submitted.add(nxt)
            await self._submit(rid, nxt, next_input)

    async def _emit_final(self, rid: str, stage_id: int, state: ReqState, out: StageOutput) -> bool:
        """Step 4: emit a final stage's output; True if that ended the request (cleaned up)."""
        done = state.finals <= state.finished
        if done:
            self._cleanup(rid)
        reason, usage = out.finish_reason, out.usage  # the stage's, on its finished output
        self._emit(OrchOutput(rid, stage_id, out.data, done, finish_reason=reason, usage=usage))
        return done

    async def _submit(self, request_id: str, stage_id: int, data: Any) -> None:
        """Submit; a failing stage ends this request alone with one error output."""
        state = self.request_states.get(request_id)
        params = state.params if state is not None else None
        try:
            await self.stages[stage_id].submit(request_id, data, params)
        except Exception as e:  # the stage's code (as `foreign.acall`, inline: once per
            # submit): that request alone fails
            log.warning("stage %d submit failed: %r", stage_id, e, extra={"request_id": request_id})
            if request_id in self.request_states:
                error = f"stage {stage_id} submit failed: {Raised(e).describe()}"
                await self._fail(request_id, stage_id, error)

    async def _fail(
        self, request_id: str, stage_id: int, error: str, code: str | None = None
    ) -> None:
        """End one request with exactly one error output; every other request goes on.

        Stages that still hold the request (streaming mode starts them all) are aborted.
        """
        state = self.request_states.get(request_id)
        self._cleanup(request_id)
        self._emit(OrchOutput(request_id, stage_id, None, True, error=error, error_code=code))
        if state is not None:
            await self._abort_stages(request_id, state.submitted - {stage_id} - state.finished)

    async def _end_with_error(self, request_id: str, error: str) -> None:
        """`_fail` for a request that failed here, not at a stage (`OrchestratorLoops._contain`):
        every stage that may hold it is aborted; one never registered gets its final too."""
        state = self.request_states.get(request_id)
        stage_id = max(state.submitted, default=0) if state is not None else 0
        self._cleanup(request_id)
        self._emit(OrchOutput(request_id, stage_id, None, True, error=error))
        if state is not None:
            await self._abort_stages(request_id, state.submitted - state.finished)

    def _drop(self, stage_id: int, out: StageOutput) -> None:
        log.debug("output of stage %d dropped", stage_id, extra={"request_id": out.request_id})
        self.dropped_outputs += 1
        if self.metrics is not None:
            self.metrics.inc("omni_dropped_outputs_total", stage=stage_id)

    def _cleanup(self, request_id: str) -> None:
        """Forget the request; later outputs for it are dropped and counted."""
        if self.request_states.pop(request_id, None) is not None:
            self._changed(request_id, None)
        self._deadlines.cancel(request_id)
        for managed in self._managed:
            if managed is not None:
                managed.request_ended(request_id)


class StreamingOrchestrator(Orchestrator):
    """Every stage at once, reading chunks; forwards nothing."""

    async def _handle_add(
        self, request_id: str, prompt: Any, params: dict[str, Any] | None = None
    ) -> None:
        state = await self._register_or_reject(request_id, prompt, params)
        if state is None:
            return
        # Downstream first: a receiver is listening before its upstream's first chunk.
        for sid in reversed(range(state.last_stage + 1)):
            state.submitted.add(sid)
            await self._submit(request_id, sid, prompt)
            if request_id not in self.request_states:
                return  # that submit failed and ended the request

    async def _handle_output(self, stage_id: int, out: StageOutput) -> None:
        """Steps 1-4 of the base class; step 5 (forwarding) is the workers' job here."""
        state = await self._record(stage_id, out)
        if state is not None and stage_id in state.finals:
            await self._emit_final(out.request_id, stage_id, state, out)
