"""Per-request timelines in Redis: RedisTracer, `trace` table and PNG, OpenTelemetry export."""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rich.console import Console

from omni_runtime import keys
from omni_runtime.observe.start import tracer_for
from omni_runtime.observe.tracing import (
    FanOutTracer,
    MemoryTracer,
    RedisTracer,
    read_redis_trace,
)
from omni_runtime.ops.trace_view import add_trace_arguments, run_trace, stage_spans
from omni_runtime.settings import Settings
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

SETTINGS = Settings(redis_url="redis://unused")
N = SETTINGS.names
CHAIN = [
    "input_submitted",
    "input_write_start",
    "input_written",
    "input_read",
    "output_read",
    "output_returned",
]


@pytest.fixture(params=["fakeredis", "redis-server"])
def client(request: pytest.FixtureRequest) -> Any:
    if request.param == "fakeredis":
        c: redis.Redis = fakeredis.FakeRedis()
    else:
        c = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    yield c
    c.close()


def _stamp_a_request(tracer: Any, rid: str) -> None:
    t = time.monotonic_ns()
    tracer.stamp("client_submitted", rid, None, t)
    tracer.stamp("request_read", rid, None, t + 300_000)
    for sid in (0, 1, 2):
        for i, event in enumerate(CHAIN):
            tracer.stamp(
                event, rid, sid, t + 1_000_000 * (1 + 4 * sid) + 250_000 * i + sid * 90_000
            )


def test_stamps_land_in_a_per_request_list_with_a_ttl(client: redis.Redis) -> None:
    tracer = RedisTracer(client, N, ttl_s=120).start()
    try:
        before = time.time_ns()
        _stamp_a_request(tracer, "r1")
        tracer.stamp("client_submitted", "r2")
        assert tracer.flush()
    finally:
        tracer.close()
    stamps = read_redis_trace(client, N, "r1")
    assert len(stamps) == 2 + 3 * len(CHAIN) and tracer.dropped == 0
    assert [s[0] for s in stamps[:3]] == ["client_submitted", "request_read", "input_submitted"]
    assert abs(stamps[0][3] - before) < 60 * 10**9  # wall clock, not monotonic
    assert 0 < client.ttl(N.trace("r1")) <= 120
    assert [s[0] for s in read_redis_trace(client, N, "r2")] == ["client_submitted"]


def test_a_full_queue_drops_instead_of_blocking() -> None:
    tracer = RedisTracer(fakeredis.FakeRedis(), N, max_queue=10, flush_interval_s=60).start()
    try:
        for i in range(50):
            tracer.stamp("input_read", "r", i)
        assert tracer.dropped >= 40
    finally:
        tracer.close()


def test_redis_down_counts_dropped_stamps() -> None:
    dead = redis.Redis(port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    tracer = RedisTracer(dead, N, flush_interval_s=0.01).start()
    try:
        tracer.stamp("input_read", "r", 0)
        wait_until(lambda: tracer.dropped == 1)
    finally:
        tracer.close()


def test_trace_list_is_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys, "TRACE_MAX_EVENTS", 5)
    r = fakeredis.FakeRedis()
    tracer = RedisTracer(r, N).start()
    for i in range(12):
        tracer.stamp("input_read", "r", i)
    assert tracer.flush()
    tracer.close()
    assert r.llen(N.trace("r")) == 5


def test_tracer_for_builds_what_the_settings_ask(tmp_path: Path) -> None:
    server = fakeredis.FakeServer()
    assert tracer_for(None) is None
    both = tracer_for(tmp_path / "t.log", True, lambda: fakeredis.FakeRedis(server=server), N)
    assert isinstance(both, FanOutTracer) and len(both.tracers) == 2
    both.stamp("request_read", "r9")
    redis_tracer = both.tracers[1]
    assert isinstance(redis_tracer, RedisTracer) and redis_tracer.flush()
    redis_tracer.close()
    assert read_redis_trace(fakeredis.FakeRedis(server=server), N, "r9")
    assert (tmp_path / "t.log").read_text().startswith("request_read r9 - ")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_trace_arguments(parser)
    return parser.parse_args(argv)


def _traced(client: redis.Redis, rid: str) -> None:
    tracer = RedisTracer(client, N).start()
    _stamp_a_request(tracer, rid)
    assert tracer.flush()
    tracer.close()


def test_trace_command_prints_the_timeline_and_draws_a_png(
    client: redis.Redis, tmp_path: Path
) -> None:
    _traced(client, "req-7")
    png = tmp_path / "t.png"
    buf = io.StringIO()
    rc = run_trace(
        _args("req-7", "--png", str(png)), SETTINGS, client, Console(file=buf, width=120)
    )
    text = buf.getvalue()
    assert rc == 0
    assert "request req-7: 20 stamps" in text and "output_returned" in text and "stage 2" in text
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_trace_command_json_and_missing_request(client: redis.Redis) -> None:
    _traced(client, "req-8")
    buf = io.StringIO()
    assert run_trace(_args("req-8", "--json"), SETTINGS, client, Console(file=buf)) == 0
    rows = json.loads(buf.getvalue())
    assert rows[0]["event"] == "client_submitted" and rows[-1]["stage"] == 2
    buf = io.StringIO()
    assert run_trace(_args("nope"), SETTINGS, client, Console(file=buf)) == 1
    assert "OMNI_TRACE=1" in buf.getvalue()


def test_stage_spans_cover_each_lane() -> None:
    tracer = MemoryTracer()
    _stamp_a_request(tracer, "r")
    lanes = [lane for lane, _a, _b in stage_spans(sorted(tracer.events, key=lambda s: s[3]))]
    assert lanes == ["request", "stage 0", "stage 1", "stage 2"]
