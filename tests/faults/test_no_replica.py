"""The only replica of a stage SIGKILLed: its requests end with "no live worker for stage 1"
within the heartbeat TTL + 2 s, and later ones are refused at once; none waits out its
deadline, none is lost."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2

pytestmark = [pytest.mark.solo, pytest.mark.timeout(300), pytest.mark.redis_server]


async def test_a_stage_with_no_live_replica_is_a_fast_error(redis_url: str, tmp_path: Path) -> None:
    n, concurrency = (2000, 200) if FULL else (200, 50)
    with FaultDeployment(
        redis_url,
        tmp_path,
        "seed.yaml",
        final_stage_ids=[2],
        stages={1: {"options": {"delay_ms": 20}}},
    ) as d:

        async def kill_the_only_replica() -> None:
            d.signal("stage1", signal.SIGKILL)
            await asyncio.sleep(0)

        prompts = {f"n{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d,
            "no live replica",
            prompts,
            seed_final_2,
            concurrency,
            n // 4,
            kill_the_only_replica,
            timeout_s=20,
        )
        ttl_s = d.settings.heartbeat_ttl_s
    print("\n" + header() + "\n" + report.line() + f"  errors={report.errors}")
    assert ttl_s is not None
    assert (report.wrong, report.lost) == (0, 0), report
    assert set(report.errors) == {"no live worker for stage 1"}, report
    assert report.ok + report.failed == n and report.failed > 0, report
    assert report.recovery_s is not None and report.recovery_s <= ttl_s + 2, report
