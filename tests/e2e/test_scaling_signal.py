"""The autoscaling signal as the orchestrator exports it (`observe/scaling.py`), on a real
redis-server with real processes: a stage scaled to zero gets a burst of 1,000 requests, its
backlog and desired-replicas hint go up to them; a replica started drains them back to 0.
And the backlog stays true when `MAXLEN` trims entries the group never read (Redis' own
lag does not)."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from omni_runtime import keys
from omni_runtime.client.client import OmniClient
from omni_runtime.local.redis_server import free_ports
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.poller import StreamStatsPoller
from omni_runtime.settings import Settings
from tests.faults.harness import FaultDeployment

pytestmark = [pytest.mark.timeout(180)]

BURST = 1000
TARGET = 100
"""OMNI_SCALE_TARGET_PER_REPLICA: the hint is ceil((backlog + in flight) / 100)."""


def stage_gauges(port: int, stage: int) -> dict[str, float]:
    """The orchestrator's `omni_stage_*` gauges of one stage, as Prometheus scrapes them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("omni_stage_") and sample.labels.get("stage") == str(stage):
                found[sample.name] = sample.value
    return found


async def test_backlog_and_hint_follow_a_burst_up_and_back_to_zero(
    redis_url: str, tmp_path: Path
) -> None:
    port = free_ports(4)
    env = {
        "OMNI_METRICS_PORT": str(port),  # the orchestrator (started first) serves on it
        "OMNI_STATS_INTERVAL_S": "0.1",
        "OMNI_SCALE_TARGET_PER_REPLICA": str(TARGET),
        "OMNI_SCALE_TO_ZERO": "true",
    }
    with FaultDeployment(redis_url, tmp_path, "seed.yaml", final_stage_ids=[2], env=env) as d:
        async with OmniClient(d.settings) as client:
            await client.wait_ready([0, 1, 2], timeout_s=60)
            procs = {name: proc for name, proc, _f in d.group.procs}
            # Scaled to zero: the only stage-1 replica drains (nothing in hand) and exits 0.
            procs["stage1-upper_all-0"].send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(procs["stage1-upper_all-0"].wait, 10) == 0

            rids = [await client.submit(f"a{i} b{i}") for i in range(BURST)]
            seen: list[dict[str, float]] = []

            async def gauges_until(done: object, timeout_s: float) -> dict[str, float]:
                deadline = time.monotonic() + timeout_s
                while True:
                    g = await asyncio.to_thread(stage_gauges, port, 1)
                    seen.append(g)
                    if callable(done) and done(g):
                        return g
                    assert time.monotonic() < deadline, seen[-5:]
                    await asyncio.sleep(0.05)  # the next scrape: the poller sets them each 0.1 s

            full = await gauges_until(lambda g: g.get("omni_stage_backlog_entries") == BURST, 60)
            assert full["omni_stage_in_flight"] == 0 and full["omni_stage_capacity"] == 0, full
            assert full["omni_stage_desired_replicas"] == BURST // TARGET, full

            cmd = [sys.executable, "-m", "omni_runtime.cli", "worker", "--pipeline", str(d.path)]
            d.group._spawn("stage1-scaled-up", [*cmd, "--mode", d.pipeline.mode, "--stage", "1"])
            empty = await gauges_until(
                lambda g: (
                    g.get("omni_stage_backlog_entries") == 0
                    and g.get("omni_stage_in_flight") == 0
                    and g.get("omni_stage_capacity", 0) > 0
                ),
                60,
            )
            assert empty["omni_stage_desired_replicas"] == 0, empty
            assert empty["omni_stage_capacity"] == 32, empty  # one replica x its concurrency
            for rid in rids:  # every request of the burst ended, exact
                outs = [o async for o in client.stream(rid, timeout_s=30)]
                assert outs[-1].finished and outs[-1].error is None, outs[-1]
    hints = [g["omni_stage_desired_replicas"] for g in seen if "omni_stage_desired_replicas" in g]
    assert max(hints) == BURST // TARGET and hints[-1] == 0, hints


def test_backlog_stays_true_when_maxlen_trims_unread_entries(redis_url: str) -> None:
    """Workers acknowledge and delete each input; a caught-up group then gets a burst that
    `MAXLEN` trims: Redis' lag still counts the trimmed entries, the gauge does not."""
    settings = Settings(redis_url=redis_url, namespace="trim")
    names = settings.names
    r = redis.Redis.from_url(redis_url)
    stream = names.stage_in(0)
    r.xgroup_create(stream, keys.WORKERS_GROUP, id="$", mkstream=True)
    first = r.xadd(stream, {"m": b"x"})
    r.xreadgroup(keys.WORKERS_GROUP, "w", {stream: ">"}, count=1)
    r.xack(stream, keys.WORKERS_GROUP, first)
    r.xdel(stream, first)
    for i in range(10):
        r.xadd(stream, {"m": str(i).encode()}, maxlen=3, approximate=False)
    r.xreadgroup(keys.WORKERS_GROUP, "w", {stream: ">"}, count=1)  # one in flight
    r.set(names.stage_heartbeat(0, "w"), '{"max_concurrency": 4}', ex=30)

    metrics = Metrics()
    StreamStatsPoller(
        r, names, metrics, "orchestrator",
        default_concurrency=settings.worker_max_concurrency,
        target=settings.scale_target_per_replica,
    ).poll_once()  # fmt: skip
    gauges = metrics.gauges()
    lag = r.xinfo_groups(stream)[0]["lag"]
    assert lag is None or lag > 2, lag  # what the stream scaler reads: not the truth
    assert gauges["omni_stage_backlog_entries"][(("stage", "0"),)] == 2  # 3 held, 1 in flight
    assert gauges["omni_stage_in_flight"][(("stage", "0"),)] == 1
    assert gauges["omni_stage_capacity"][(("stage", "0"),)] == 4
    assert gauges["omni_stage_desired_replicas"][(("stage", "0"),)] == 1  # ceil(3 / 4)
    r.close()
