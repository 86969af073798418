"""A replica stalled past its heartbeat TTL (SIGSTOP), then resumed (SIGCONT): another replica
has taken its inputs over; the stalled one, fenced, gives them up unpublished (and the
orchestrator drops repeats as a backstop), so the client sees every request once, exact."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2

pytestmark = [pytest.mark.solo, pytest.mark.timeout(300), pytest.mark.redis_server]


async def test_sigstop_past_the_ttl_then_sigcont_loses_and_repeats_nothing(
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
        stall_s = d.settings.heartbeat_ttl_s or 5.0
        stalled = d.pid("stage1")

        async def stall_one_replica() -> None:
            d.signal("stage1", signal.SIGSTOP)
            await asyncio.sleep(stall_s + 2)  # the fault itself: a stall past the TTL
            d.signal_pid(stalled, signal.SIGCONT)

        prompts = {f"s{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d,
            "replica SIGSTOP/SIGCONT",
            prompts,
            seed_final_2,
            concurrency,
            n // 4,
            stall_one_replica,
        )
        d.group.check_alive()
        # Fenced at the source: each input claimed from the stalled replica, it gives up
        # unpublished (its heartbeat document shows it a beat after it resumed).
        docs = await d.wait_worker_status(
            1, lambda docs: 0 < _sum(docs, "takeovers") == _sum(docs, "deposed"), 15.0
        )
    print("\n" + header() + "\n" + report.line())
    assert (report.ok, report.lost, report.wrong, report.duplicated) == (n, 0, 0, 0), report
    assert report.recovery_s is not None and report.recovery_s <= stall_s + 8, report
    assert len(docs) == 2 and _sum(docs, "takeovers") == _sum(docs, "deposed"), docs


def _sum(docs: list[dict[str, Any]], counter: str) -> int:
    return sum(int(doc.get(counter, 0)) for doc in docs)
