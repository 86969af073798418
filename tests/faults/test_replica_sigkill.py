"""A replica SIGKILLed under load: its inputs are taken over; nothing lost, nothing repeated."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2

pytestmark = [pytest.mark.solo, pytest.mark.timeout(300), pytest.mark.redis_server]


async def test_sigkill_of_a_replica_under_load_loses_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = (2000, 200) if FULL else (300, 50)
    with FaultDeployment(
        redis_url,
        tmp_path,
        "seed.yaml",
        final_stage_ids=[2],
        stages={1: {"replicas": 2, "options": {"delay_ms": 5}}},
    ) as d:

        async def kill_one_replica() -> None:
            d.signal("stage1", signal.SIGKILL)
            await asyncio.sleep(0)

        prompts = {f"k{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d, "replica SIGKILL", prompts, seed_final_2, concurrency, n // 4, kill_one_replica
        )
    print("\n" + header() + "\n" + report.line())
    assert (report.ok, report.lost, report.wrong, report.duplicated) == (n, 0, 0, 0), report
    assert report.recovery_s is not None and report.recovery_s <= 6 + 5, report
