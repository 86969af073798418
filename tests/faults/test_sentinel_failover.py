"""Redis Sentinel: the primary SIGKILLed under load (1,000 requests at concurrency 100);
the promises are `tests/faults/failover.py`'s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_runtime.errors import OmniError
from omni_runtime.local.redis_sentinel import RedisSentinelSet
from omni_runtime.local.redis_server import redis_server_binary
from tests.faults.failover import fail_over_under_load
from tests.services import unavailable

pytestmark = [pytest.mark.solo, pytest.mark.timeout(300), pytest.mark.redis_server]

DOWN_AFTER_MS = 1000
"""Sentinel's `down-after-milliseconds`, tuned down from 30 s so the test fails over in
seconds (a production value is a trade between failover time and false alarms)."""


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
    with sentinels() as ha:

        def kill_and_wait() -> None:
            old = ha.primary_port()
            assert old is not None
            proc = ha.server(old).proc
            assert proc is not None
            proc.kill()
            ha.wait_primary_other_than(old, 60)

        await fail_over_under_load(ha.url, tmp_path, "sentinel: primary SIGKILL", kill_and_wait)
