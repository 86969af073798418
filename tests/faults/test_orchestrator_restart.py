"""The only orchestrator SIGKILLed under load and restarted 1 s later: the new process
takes the dead one's slot over once its lease lapses, restores the requests in flight
from their durable state and finishes them; nothing lost, no final twice."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2
from tests.faults.orchestrators import ENV, LEASE_TTL_S, wait_for_slots

pytestmark = [pytest.mark.solo, pytest.mark.timeout(300), pytest.mark.redis_server]


async def test_sigkill_and_restart_of_the_only_orchestrator_loses_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = (2000, 200) if FULL else (300, 50)
    with FaultDeployment(
        redis_url,
        tmp_path,
        "seed.yaml",
        env=ENV,
        final_stage_ids=[2],
        stages={1: {"options": {"delay_ms": 5}}},
    ) as d:
        await wait_for_slots(d.redis, d.settings.names, 1)

        async def kill_and_restart() -> None:
            d.signal("orchestrator", signal.SIGKILL)
            await asyncio.sleep(1.0)  # the fault itself: down for 1 s
            d.spawn_orchestrator("orchestrator-restarted")

        prompts = {f"r{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d,
            "orchestrator SIGKILL+restart",
            prompts,
            seed_final_2,
            concurrency,
            n // 4,
            kill_and_restart,
        )
        assert d.pid("orchestrator-restarted")
    print("\n" + header() + "\n" + report.line())
    assert (report.ok, report.lost, report.wrong, report.duplicated) == (n, 0, 0, 0), report
    assert report.recovery_s is not None and report.recovery_s <= LEASE_TTL_S + 12, report
