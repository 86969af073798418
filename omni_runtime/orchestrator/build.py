"""The core orchestrator a pipeline asks for: its mode's class, with its forward function."""

from __future__ import annotations

from collections.abc import Sequence

from omni_runtime.core.loops import Hooks
from omni_runtime.core.orchestrator import Orchestrator, StreamingOrchestrator
from omni_runtime.core.types import Stage, forward_previous_data
from omni_runtime.observe.metrics import Metrics
from omni_runtime.pipeline import PipelineConfig, resolve_entry


def build_orchestrator(
    pipeline: PipelineConfig,
    stages: Sequence[Stage],
    default_deadline_s: float | None = None,
    metrics: Metrics | None = None,
    hooks: Hooks | None = None,
) -> Orchestrator:
    """The orchestrator class of the pipeline's mode, with its forward function."""
    forward = (
        resolve_entry(pipeline.forward, pipeline.source_dir)
        if pipeline.forward
        else forward_previous_data
    )
    cls = StreamingOrchestrator if pipeline.mode == "streaming" else Orchestrator
    return cls(
        stages,
        pipeline.final_stage_ids,
        forward,
        default_deadline_s,
        metrics,
        hooks,
        audio_stage=pipeline.audio_stage,
    )
