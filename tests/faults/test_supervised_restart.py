"""The only replica of a stage SIGKILLed under load, with a supervisor starting it again
as an embedded `serve` does (`ProcessGroup.restart_dead`, every 0.5 s): the process
started in its place takes its inputs over; nothing lost, nothing repeated, no request
failed (the stage never looked down: the new replica beats before the dead one's
heartbeat expires)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]

SUPERVISOR_PERIOD_S = 0.5
"""How often `serve` looks for a dead process of its deployment."""


@contextlib.asynccontextmanager
async def supervised(d: FaultDeployment, restarted: list[str]) -> AsyncIterator[None]:
    async def supervise() -> None:
        while True:
            restarted.extend(d.group.restart_dead())
            await asyncio.sleep(SUPERVISOR_PERIOD_S)

    task = asyncio.create_task(supervise())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_only_replica_killed_and_started_again_loses_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = (1000, 100) if FULL else (200, 40)
    with FaultDeployment(
        redis_url,
        tmp_path,
        "seed.yaml",
        final_stage_ids=[2],
        stages={1: {"options": {"delay_ms": 5}}},
    ) as d:
        restarted: list[str] = []

        async def kill_the_replica() -> None:
            d.signal("stage1", signal.SIGKILL)
            await asyncio.sleep(0)

        prompts = {f"s{i}": f"a{i} b{i}" for i in range(n)}
        async with supervised(d, restarted):
            report = await run_load(
                d, "only replica SIGKILL, restarted", prompts, seed_final_2, concurrency,
                n // 4, kill_the_replica,
            )  # fmt: skip
    print("\n" + header() + "\n" + report.line())
    assert restarted == ["stage1-upper_all-0"], restarted
    assert (report.ok, report.lost, report.wrong, report.duplicated) == (n, 0, 0, 0), report
    assert report.recovery_s is not None and report.recovery_s <= 6 + 5, report
