"""Redis Cluster with replicas (3 primaries, 3 replicas): one primary SIGKILLed under load
(1,000 requests at concurrency 100). The runtime rides out the failover (connection
errors, CLUSTERDOWN, MOVED to the promoted replica, TRYAGAIN); the promises are
`tests/faults/failover.py`'s, and the recovery time is reported."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_runtime.errors import OmniError
from omni_runtime.local.redis_cluster import RedisCluster
from omni_runtime.local.redis_server import redis_server_binary
from tests.faults.failover import fail_over_under_load
from tests.services import unavailable

pytestmark = [pytest.mark.solo, pytest.mark.timeout(300), pytest.mark.redis_server]

NODE_TIMEOUT_MS = 5000
"""`cluster-node-timeout` (CI's; Redis's default is 15 s): the replica takes over after
6-7 s, longer than the heartbeat and lease TTLs (5 s), the hard case: heartbeat keys
lapse, a worker's fence closes, the orchestrator's lease is set again."""


@contextlib.contextmanager
def cluster() -> Iterator[RedisCluster]:
    """A private cluster: the scenario kills one of its primaries."""
    if redis_server_binary() is None:
        unavailable("no redis-server on PATH", "redis-server")
    nodes = RedisCluster(masters=3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS, timeout_s=30)
    try:
        nodes.start()
    except OmniError as e:
        unavailable(f"cannot start a Redis Cluster with replicas: {e}", "redis-server")
    try:
        yield nodes
    finally:
        nodes.stop()


async def test_sigkill_of_a_primary_fails_over_with_one_final_each(tmp_path: Path) -> None:
    with cluster() as nodes:
        victim = nodes.nodes[1]  # the deployment's URL is the first primary's

        def kill_and_wait() -> None:
            assert victim.proc is not None
            victim.proc.kill()
            nodes.wait_failover(victim.port, 60)

        await fail_over_under_load(nodes.url, tmp_path, "cluster: primary SIGKILL", kill_and_wait)
