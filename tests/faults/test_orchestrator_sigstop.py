"""One of two orchestrators stalled past its lease (SIGSTOP), then resumed (SIGCONT): the
other took its slot over meanwhile; the stalled one finds its lease taken and stops, and
nothing it queued reaches Redis. No final twice at the client, and no stage is ever
submitted the same request twice (counted on the Redis side, with MONITOR)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import pytest

from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2
from tests.faults.orchestrators import ENV, LEASE_TTL_S, TakeoverClock, leases, wait_for_slots
from tests.faults.submissions import SubmissionCounter
from tests.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]

STALL_S = LEASE_TTL_S + 2.0


async def test_sigstop_of_an_orchestrator_past_its_lease_repeats_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = (2000, 200) if FULL else (300, 50)
    with (
        FaultDeployment(
            redis_url,
            tmp_path,
            "seed.yaml",
            orchestrators=2,
            env=ENV,
            final_stage_ids=[2],
            stages={1: {"options": {"delay_ms": 5}}},
        ) as d,
        SubmissionCounter(redis_url, d.namespace) as submissions,
    ):
        names = d.settings.names
        await wait_for_slots(d.redis, names, 2)
        clock = TakeoverClock(d.redis, names, leases(d.redis, names))
        stalled = d.pid("orchestrator")

        async def stall_one_orchestrator() -> None:
            d.signal_pid(stalled, signal.SIGSTOP)
            timing = asyncio.create_task(clock.run(timeout_s=STALL_S + 5))
            await asyncio.sleep(STALL_S)  # the fault itself: a stall past the lease
            await timing  # the other process holds the slot now
            d.signal_pid(stalled, signal.SIGCONT)

        prompts = {f"s{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d,
            "orchestrator SIGSTOP/SIGCONT",
            prompts,
            seed_final_2,
            concurrency,
            n // 4,
            stall_one_orchestrator,
        )
        with contextlib.suppress(AssertionError):  # still running: the assert below says so
            await wait_for(lambda: d.exit_code(stalled) is not None, deadline_s=30)
        exit_code = d.exit_code(stalled)
        log = d.group.tail("orchestrator", 15)
    assert submissions.caught_up, "MONITOR did not catch up"
    doubles = submissions.doubles()
    print(
        "\n" + header() + "\n" + report.line() + f"  submissions={sum(submissions.counts.values())}"
        f" double={len(doubles)} takeover={clock.takeover_s}s deposed_exit={exit_code}"
    )
    assert (report.ok, report.lost, report.wrong, report.duplicated) == (n, 0, 0, 0), report
    # Every request was submitted to each of the three stages, each exactly once.
    assert {rid for _sid, rid in submissions.counts} == set(prompts)
    assert len(submissions.counts) == 3 * n and doubles == {}, doubles
    assert exit_code is not None and exit_code != 0, (
        f"the deposed orchestrator kept running:\n{log}"
    )
