"""omni-runtime: multi-stage model pipelines, every stage its own process, all over Redis."""

from omni_runtime.chunks.adapter import ChunkAdapter
from omni_runtime.chunks.memory import MemoryConnector
from omni_runtime.core.in_memory import InMemoryStage
from omni_runtime.core.orchestrator import Orchestrator
from omni_runtime.core.streaming import StreamingOrchestrator
from omni_runtime.core.types import OrchOutput, ReqState, StageOutput

__all__ = [
    "ChunkAdapter",
    "InMemoryStage",
    "MemoryConnector",
    "OrchOutput",
    "Orchestrator",
    "ReqState",
    "StageOutput",
    "StreamingOrchestrator",
]
__version__ = "0.1.0"
