"""omni-runtime: multi-stage model pipelines, every stage its own process, all over Redis.

The names below are imported on first use (PEP 562): `import omni_runtime.cli` or any
other submodule must not pay for redis, the chunk adapter and the cores (~0.3 s) when
the process needs none of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omni_runtime.chunks.adapter import ChunkAdapter
    from omni_runtime.chunks.memory import MemoryConnector
    from omni_runtime.core.in_memory import InMemoryStage
    from omni_runtime.core.orchestrator import Orchestrator, StreamingOrchestrator
    from omni_runtime.core.types import OrchOutput, ReqState, StageOutput

_EXPORTS = {
    "ChunkAdapter": "omni_runtime.chunks.adapter",
    "InMemoryStage": "omni_runtime.core.in_memory",
    "MemoryConnector": "omni_runtime.chunks.memory",
    "OrchOutput": "omni_runtime.core.types",
    "Orchestrator": "omni_runtime.core.orchestrator",
    "ReqState": "omni_runtime.core.types",
    "StageOutput": "omni_runtime.core.types",
    "StreamingOrchestrator": "omni_runtime.core.orchestrator",
}

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
