"""omni-runtime: multi-stage model pipelines, every stage its own process, all over Redis."""

from omni_runtime.chunk_adapter import ChunkAdapter
from omni_runtime.orchestrator import Orchestrator
from omni_runtime.types import OrchOutput, ReqState, StageOutput

__all__ = ["ChunkAdapter", "OrchOutput", "Orchestrator", "ReqState", "StageOutput"]
__version__ = "0.1.0"
