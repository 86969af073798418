"""The engines the async engine contract (`test_async_engine_contract.py`) runs against.

Each `EngineCase` builds an unstarted engine with a given number of batch slots and
names two inputs: one it answers (as long as `max_tokens` asks) and one that fails its
request. To put another adapter through the same suite, append a case to
`ENGINE_CASES`; give it `requires` (the package it needs), so that the suite skips it
where that package is not installed and fails under CI=true, e.g.

    ENGINE_CASES.append(EngineCase("llama_cpp", build_llama, prompt="Tell me a story.",
                                   failing=("hi", {"max_tokens": -1}), requires="xllamacpp"))
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
    requires: str | None = None
    """A module the engine needs; without it the case is skipped (a failure under CI=true)."""

    def require(self) -> None:
        if self.requires is not None and importlib.util.find_spec(self.requires) is None:
            unavailable(f"{self.requires} is not installed", f"the {self.requires} package")

    @property
    def long(self) -> dict[str, Any]:
        return self.long_params or {"max_tokens": 1_000_000}


def tiny(capacity: int) -> AsyncStageEngine:
    return TinyAsyncEngine(capacity=capacity, token_delay_ms=1)


def fake_vllm(capacity: int) -> AsyncStageEngine:
    """The real adapter over the fake `AsyncLLM`: the adapter's code is what runs."""
    api = FakeVllm(token_delay_s=0.001).api()
    return VllmEngine("fake/model", engine_args={"max_num_seqs": capacity}, api=api)


ENGINE_CASES: list[EngineCase] = [
    EngineCase("tiny", tiny, prompt="one two three", failing=("one boom", None)),
    EngineCase("vllm_fake", fake_vllm, prompt="tell me more", failing=("say boom", None)),
]
"""The suite runs once per case, in this order."""
