"""omni-runtime: multi-stage model pipelines, every stage its own process, all over Redis."""

from omni_runtime.chunks.adapter import ChunkAdapter
from omni_runtime.core.orchestrator import Orchestrator
from omni_runtime.core.types import OrchOutput, ReqState, StageOutput

__all__ = ["ChunkAdapter", "OrchOutput", "Orchestrator", "ReqState", "StageOutput"]
__version__ = "0.1.0"
