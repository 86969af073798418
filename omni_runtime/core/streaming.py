"""Streaming ("async chunk") mode: every stage starts at once and reads its input as chunks.

The orchestrator still sees every stage's outputs, to emit the final stages'
and to know when a request is done, but forwards nothing: stage n+1 consumes
stage n's chunks straight from the data plane (the ChunkAdapter). Only
`_handle_add` and `_handle_output` differ from the sequential base class.
"""

from __future__ import annotations

from typing import Any

from omni_runtime.core.orchestrator import Orchestrator
from omni_runtime.core.types import StageOutput


class StreamingOrchestrator(Orchestrator):
    async def _handle_add(
        self, request_id: str, prompt: Any, params: dict[str, Any] | None = None
    ) -> None:
        state = await self._register_or_reject(request_id, prompt, params)
        if state is None:
            return
        # Downstream first: a receiver is listening before its upstream's first chunk.
        for sid in reversed(range(self.last_stage + 1)):
            state.submitted.add(sid)
            await self._submit(request_id, sid, prompt)
            if request_id not in self.request_states:
                return  # that submit failed and ended the request

    async def _handle_output(self, stage_id: int, out: StageOutput) -> None:
        """Steps 1-4 of the base class; step 5 (forwarding) is the workers' job here."""
        state = await self._record(stage_id, out)
        if state is not None and stage_id in self.final_stage_ids:
            await self._emit_final(out.request_id, stage_id, state, out)
