"""Async engines in real worker processes on a real redis-server: a tiny engine reading
its upstream's chunks as they stream in, and the vLLM adapter (over the fake `AsyncLLM`)
as a pipeline's thinker, named in a pipeline file as a user would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import FaultDeployment, run_load

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]


def spoken(prompt: str) -> list[tuple[int, Any, bool]]:
    words = prompt.split()
    return [(1, w.upper(), i == len(words) - 1) for i, w in enumerate(words)]


async def test_an_async_engine_reads_a_streamed_input_as_it_arrives(
    redis_url: str, tmp_path: Path
) -> None:
    stage = {"entry": "tests.engines.tiny_async:TinyAsyncEngine", "options": {"capacity": 4}}
    with FaultDeployment(
        redis_url, tmp_path, "seed.yaml", mode="streaming", final_stage_ids=[1], stages={1: stage}
    ) as d:
        prompts = {f"s{i}": " ".join(f"w{i}x{j}" for j in range(i % 5 + 1)) for i in range(40)}
        report = await run_load(d, "async engine, streaming", prompts, spoken, concurrency=8)
    assert (report.ok, report.failed, report.lost, report.duplicated) == (40, 0, 0, 0), report


def thought(prompt: str) -> list[tuple[int, Any, bool]]:
    """The fake AsyncLLM says the prompt's words over and over: 3 tokens (`max_tokens`)."""
    words = prompt.split()
    return [(0, f" {words[i % len(words)]}", i == 2) for i in range(3)]


async def test_the_vllm_adapter_serves_a_pipeline_stage(redis_url: str, tmp_path: Path) -> None:
    thinker = {
        "entry": "omni_runtime.engines.vllm:VllmEngine",
        "options": {
            "model": "fake/model",
            "api": "tests.engines.fake_vllm:api",
            "engine_args": {"max_num_seqs": 4},
            "sampling": {"max_tokens": 3},
        },
    }
    with FaultDeployment(
        redis_url, tmp_path, "seed.yaml", final_stage_ids=[0], stages={0: thinker}
    ) as d:
        prompts = {f"v{i}": f"hello number {i}" for i in range(40)}
        report = await run_load(d, "vLLM adapter (fake AsyncLLM)", prompts, thought, 8)
        (status,) = await d.wait_worker_status(0, lambda docs: len(docs) == 1, timeout_s=10)
    assert (report.ok, report.failed, report.lost, report.duplicated) == (40, 0, 0, 0), report
    assert status["engine"] == {"running": 0, "waiting": 0, "capacity": 4}, status
