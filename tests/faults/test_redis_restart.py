"""Redis restarted empty mid-load: every request completes or ends with one error final
saying its state was lost, within 10 s (one no orchestrator had read yet: at its deadline
and the client's grace); no client is taken for gone; no partial success; no request is
reported lost and then succeeds."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from omni_runtime.redis_io.client_deadlines import DEADLINE_EXCEEDED
from omni_runtime.wire.messages import REDIS_LOST_STATE
from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2
from tests.faults.orchestrators import ENV
from tests.faults.private_redis import PrivateRedis

pytestmark = [pytest.mark.solo, pytest.mark.timeout(300)]

RESTART_BOUND_S = 10.0
DEADLINE_S = 15.0
"""A request written to Redis just before it died, never read by an orchestrator, is known
to nobody: it ends at its deadline (plus the client's grace), at the client."""


async def test_empty_redis_restart_loses_no_client_and_no_data_silently(tmp_path: Path) -> None:
    n, concurrency = (2000, 200) if FULL else (300, 50)
    with (
        PrivateRedis(tmp_path) as server,
        FaultDeployment(
            server.url,
            tmp_path,
            "seed.yaml",
            env={"OMNI_DEADLINE_S": str(DEADLINE_S)},
            final_stage_ids=[2],
            stages={1: {"options": {"delay_ms": 5}}},
        ) as d,
    ):
        d.settings = d.settings.model_copy(update={"deadline_s": DEADLINE_S})
        restarted: list[float] = []

        async def restart_redis() -> None:
            started = time.monotonic()
            await asyncio.to_thread(server.restart)
            restarted.append(time.monotonic() - started)

        prompts = {f"r{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d, "redis restart (empty)", prompts, seed_final_2, concurrency, n // 4, restart_redis
        )
    print(
        "\n"
        + header()
        + "\n"
        + report.line()
        + f"  errors={report.errors} late successes={report.late_successes}"
    )
    assert report.errors.get("client went away", 0) == 0, report
    # Each failed request says its data was lost: the orchestrator saw the restart ("state
    # lost"), or the client saw the gap first ("outputs lost", the sequence check), or nobody
    # had it and its deadline passed; never a partial success.
    assert set(report.errors) <= {REDIS_LOST_STATE, "outputs lost", DEADLINE_EXCEEDED}, report
    assert (report.wrong, report.lost) == (0, 0), report
    assert report.ok + report.failed == n, report
    assert report.late_successes.get(REDIS_LOST_STATE, 0) == 0, report
    assert report.late_successes.get(DEADLINE_EXCEEDED, 0) == 0, report
    assert report.recovery_s is not None
    bound_s = RESTART_BOUND_S + restarted[0]
    if report.errors.get(DEADLINE_EXCEEDED):
        bound_s = max(bound_s, DEADLINE_S + d.settings.deadline_grace_s + restarted[0])
    assert report.recovery_s <= bound_s, report


async def test_redis_restart_with_aof_loses_nothing(tmp_path: Path) -> None:
    """`appendfsync always`: every write Redis acknowledged survives; no request ends with
    a lost-state error (the epoch token survives), none is taken for gone."""
    n, concurrency = (2000, 200) if FULL else (300, 50)
    with (
        PrivateRedis(tmp_path, aof=True) as server,
        FaultDeployment(
            server.url, tmp_path, "seed.yaml", final_stage_ids=[2], stages={1: {}}
        ) as d,
    ):

        async def restart_redis() -> None:
            await asyncio.to_thread(server.restart)

        prompts = {f"a{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d,
            "redis restart (AOF always)",
            prompts,
            seed_final_2,
            concurrency,
            n // 4,
            restart_redis,
            timeout_s=10,
        )
    print("\n" + header() + "\n" + report.line() + f"  errors={report.errors}")
    assert report.errors == {} and report.wrong == 0, report
    assert (report.ok, report.wrong, report.lost) == (n, 0, 0), report


async def test_orchestrator_and_redis_restart_with_aof(tmp_path: Path) -> None:
    """The orchestrator SIGKILLed, Redis restarted (AOF always), a new orchestrator: what
    Redis acknowledged survives, request states included, so the new process takes the
    dead one's slot over when its lease lapses and finishes every request in flight.

    A kill that cuts a write batch after its client outputs and before the state that
    records them makes the new owner send those outputs again: the client drops them by
    sequence number (the `dup` column counts them), so every request is still exact."""
    n, concurrency = (2000, 200) if FULL else (300, 50)
    with (
        PrivateRedis(tmp_path, aof=True) as server,
        FaultDeployment(
            server.url, tmp_path, "seed.yaml", env=ENV, final_stage_ids=[2], stages={1: {}}
        ) as d,
    ):

        async def restart_both() -> None:
            d.signal("orchestrator", signal.SIGKILL)
            await asyncio.to_thread(server.restart)
            d.spawn_orchestrator("orchestrator-2")

        prompts = {f"o{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d,
            "orchestrator+redis (AOF)",
            prompts,
            seed_final_2,
            concurrency,
            n // 4,
            restart_both,
            timeout_s=30,
        )
    print("\n" + header() + "\n" + report.line() + f"  errors={report.errors}")
    assert report.errors == {}, report
    assert (report.ok, report.wrong, report.lost) == (n, 0, 0), report
