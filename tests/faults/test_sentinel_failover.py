"""Redis Sentinel: the primary SIGKILLed under load (1,000 requests at concurrency 100).

Every request ends with exactly one final: exact, or (the few in flight at the kill whose
last writes the replica never got) one error saying so; none hangs past its deadline and
its grace; no partial success; new work is served again within the failover plus 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_runtime.errors import OmniError
from omni_runtime.messages import REDIS_LOST_STATE
from omni_runtime.redis_io.client_deadlines import DEADLINE_EXCEEDED
from omni_runtime.redis_sentinel import RedisSentinelSet
from omni_runtime.redis_server import redis_server_binary
from tests.faults.harness import FaultDeployment, header, run_load, seed_final_2
from tests.services import unavailable

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]

DOWN_AFTER_MS = 1000
"""Sentinel's `down-after-milliseconds`, tuned down from 30 s so the test fails over in
seconds (a production value is a trade between failover time and false alarms)."""
DEADLINE_S = 15.0
RETRY_MAX_S = 0.5
"""The runtime's longest wait between retries: the service is back within this of the
failover (the default, 2 s, would take up the whole of the target's slack)."""
RESUME_SLACK_S = 2.0
ENV = {"OMNI_DEADLINE_S": str(DEADLINE_S), "OMNI_RETRY_MAX_S": str(RETRY_MAX_S)}
LOSS_ERRORS = {REDIS_LOST_STATE, "outputs lost", DEADLINE_EXCEEDED}
"""What a request whose writes died with the old primary may end with: the orchestrator
saw its state gone, the client saw a gap in its sequence numbers, or nobody had it and its
deadline passed. Never a success with a piece missing."""


@contextlib.contextmanager
def sentinels() -> Iterator[RedisSentinelSet]:
    """A private set: the scenario kills its primary."""
    if redis_server_binary() is None:
        unavailable("no redis-server on PATH", "redis-server (for redis-server --sentinel)")
    ha = RedisSentinelSet(down_after_ms=DOWN_AFTER_MS)
    try:
        ha.start()
    except OmniError as e:
        unavailable(f"cannot start Redis Sentinel: {e}", "redis-server --sentinel")
    try:
        yield ha
    finally:
        ha.stop()


async def test_sigkill_of_the_primary_fails_over_with_one_final_each(tmp_path: Path) -> None:
    n, concurrency = 1000, 100
    failover_s: list[float] = []
    with (
        sentinels() as ha,
        FaultDeployment(
            ha.url,
            tmp_path,
            "seed.yaml",
            env=ENV,
            final_stage_ids=[2],
            stages={1: {"options": {"delay_ms": 5}}},
        ) as d,
    ):
        d.settings = d.settings.model_copy(
            update={"deadline_s": DEADLINE_S, "retry_max_s": RETRY_MAX_S}
        )

        async def kill_primary() -> None:
            old = ha.primary_port()
            assert old is not None
            killed = time.monotonic()
            proc = ha.server(old).proc
            assert proc is not None
            proc.kill()
            await asyncio.to_thread(ha.wait_primary_other_than, old, 60)
            failover_s.append(time.monotonic() - killed)

        prompts = {f"s{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d,
            "sentinel: primary SIGKILL",
            prompts,
            seed_final_2,
            concurrency,
            n // 4,
            kill_primary,
            timeout_s=DEADLINE_S + 15,
        )
    print(
        "\n" + header() + "\n" + report.line() + f"  failover_s={failover_s[0]:.2f} "
        f"resumed_s={report.resumed_s} errors={report.errors}"
    )
    assert (report.wrong, report.lost) == (0, 0), report
    assert report.ok + report.failed == n, report
    assert set(report.errors) <= LOSS_ERRORS, report.error_texts
    assert report.failed <= concurrency, report  # only requests in flight at the kill
    assert not any(report.late_successes.values()), report  # no error final, then a success
    assert report.resumed_s is not None and report.resumed_s <= failover_s[0] + RESUME_SLACK_S
