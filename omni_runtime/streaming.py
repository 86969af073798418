"""Streaming ("async chunk") mode: every stage starts at once and reads its input as chunks.

The orchestrator still sees every stage's outputs, to emit the final stages'
and to know when a request is done, but forwards nothing: stage n+1 consumes
stage n's chunks straight from the data plane (the ChunkAdapter). Only
`_handle_add` and `_handle_output` differ from the sequential base class.
"""

from __future__ import annotations

from typing import Any

from omni_runtime.orchestrator import Orchestrator
from omni_runtime.types import OrchOutput, StageFailure, StageOutput


class StreamingOrchestrator(Orchestrator):
    async def _handle_add(self, request_id: str, prompt: Any) -> None:
        state = self._register(request_id, prompt)
        if state is None:
            await self._out_q.put(
                OrchOutput(request_id, 0, None, True, error="duplicate request id")
            )
            return
        # Downstream first: a receiver is listening before its upstream's first chunk.
        for sid in reversed(range(self.last_stage + 1)):
            state.submitted.add(sid)
            await self._submit(request_id, sid, prompt)
            if request_id not in self.request_states:
                return  # that submit failed and ended the request

    async def _handle_output(self, stage_id: int, out: StageOutput) -> None:
        rid = out.request_id
        state = self.request_states.get(rid)
        if state is None:
            self.dropped_outputs += 1
            return
        if isinstance(out.data, StageFailure):
            await self._fail(rid, stage_id, out.data.error)
            return
        state.stage_data.setdefault(stage_id, []).append(out.data)
        if out.finished:
            state.finished.add(stage_id)
        if stage_id in self.final_stage_ids:
            await self._emit_final(rid, stage_id, state, out)
