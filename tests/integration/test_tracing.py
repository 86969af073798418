"""Tracing hooks: with `trace_file` set, every hand-off of a request is stamped, in order."""

from __future__ import annotations

from pathlib import Path

import fakeredis
import pytest

from omni_runtime.observe.tracing import MemoryTracer, read_trace_file
from omni_runtime.pipeline import load_pipeline
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings
from tests.cluster import InProcessCluster

pytestmark = pytest.mark.timeout(60)

WORKERS = Path(__file__).resolve().parents[2] / "workers"


async def test_every_hand_off_of_a_request_is_stamped_in_order(tmp_path: Path) -> None:
    server = fakeredis.FakeServer()
    clients = RedisClients(
        sync=lambda: fakeredis.FakeRedis(server=server),
        aio=lambda: fakeredis.FakeAsyncRedis(server=server),
    )
    trace = tmp_path / "trace.log"
    settings = Settings(
        redis_url="redis://unused",
        block_ms=20,
        orchestrator_idle_block_ms=20,  # fakeredis goes on with a cancelled blocking read
        heartbeat_interval_s=0.2,
        trace_file=trace,
    )
    async with InProcessCluster(load_pipeline(WORKERS / "seed.yaml"), settings, clients) as c:
        outs = await c.run("hi there")
    assert outs[-1].finished
    rid = outs[-1].request_id
    stamps: dict[tuple[str, int | None], int] = {}
    for event, request_id, stage_id, t_ns in read_trace_file(trace):
        if request_id == rid:
            stamps.setdefault((event, stage_id), t_ns)
    for sid in (0, 1, 2):
        chain = ["input_submitted", "input_write_start", "input_read", "output_read"]
        times = [stamps[(event, sid)] for event in chain]
        assert times == sorted(times), f"stage {sid}: {chain} out of order"
        # (the worker may read the input before the writer's reply is back)
        assert stamps[("input_write_start", sid)] <= stamps[("input_written", sid)]
        assert stamps[("output_read", sid)] <= stamps[("output_returned", sid)]
    assert stamps[("client_submitted", None)] <= stamps[("request_read", None)]
    assert stamps[("request_read", None)] <= stamps[("input_submitted", 0)]


def test_memory_tracer_keeps_what_it_was_given() -> None:
    tracer = MemoryTracer()
    tracer.stamp("input_read", "r1", 2, t_ns=5)
    assert tracer.events == [("input_read", "r1", 2, 5)]
