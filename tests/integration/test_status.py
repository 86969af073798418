"""`status` and `dead-letters` against hand-made heartbeats and streams."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import time
from types import SimpleNamespace
from typing import Any

import fakeredis
import msgpack
import pytest
import redis
import redis.asyncio as aioredis
from rich.console import Console

from omni_runtime import keys
from omni_runtime.errors import ConfigError
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.poller import StreamStatsPoller
from omni_runtime.observe.redis_stats import heartbeat_value, parse_heartbeat
from omni_runtime.ops.dead_letters import (
    RAW_CUT_BYTES,
    add_dead_letters_arguments,
    list_dead_letters,
    replay,
    run_dead_letters,
)
from omni_runtime.ops.status import add_status_arguments, run_status
from omni_runtime.orchestrator.leases import Leases
from omni_runtime.settings import Settings
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageInputMsg
from tests.redis_full import FullableRedis

pytestmark = pytest.mark.timeout(60)

SETTINGS = Settings(redis_url="redis://unused")
N = SETTINGS.names


def _deployment(r: redis.Redis) -> None:
    """An orchestrator beating a plain string, a JSON worker of stage 0, a msgpack one of stage 1,
    a client; stage 2 has a stream and no worker."""
    r.set(N.orchestrator_heartbeat(), "omni", ex=keys.HEARTBEAT_TTL_S)
    doc = {
        "host": "gpu-a",
        "pid": 41,
        "started_at": time.time() - 90,
        "in_flight": 3,
        "completed": 7,
        "engine": {"running": 2, "waiting": 1, "capacity": 2},
    }
    r.set(N.stage_heartbeat(0, "w0"), json.dumps(doc), ex=keys.HEARTBEAT_TTL_S)
    r.set(N.stage_heartbeat(1, "w1"), msgpack.packb({"host": "gpu-b", "pid": 42}), ex=5)
    r.set(N.client_heartbeat("c1"), 1, ex=keys.HEARTBEAT_TTL_S)
    for sid in (0, 1, 2):
        r.xgroup_create(N.stage_in(sid), keys.WORKERS_GROUP, id="0", mkstream=True)
    for i in range(3):
        r.xadd(N.stage_in(0), {keys.PAYLOAD_FIELD: b"x%d" % i})
    r.xreadgroup(keys.WORKERS_GROUP, "w0", {N.stage_in(0): ">"}, count=2)
    r.xgroup_create(N.requests, keys.ORCHESTRATOR_GROUP, id="0", mkstream=True)
    for _ in range(5):
        r.xadd(N.requests, {keys.PAYLOAD_FIELD: b"req"})
    r.xadd(N.client_out("c1"), {keys.PAYLOAD_FIELD: b"out"})


def _args(*argv: str, adder: Any = add_status_arguments) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    adder(parser)
    return parser.parse_args(argv)


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, force_terminal=False), buf


@pytest.fixture(params=["fakeredis", "redis-server"])
def client(request: pytest.FixtureRequest) -> Any:
    if request.param == "fakeredis":
        c: redis.Redis = fakeredis.FakeRedis()
    else:
        c = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    yield c
    c.close()


def test_status_json_shows_processes_streams_and_rate(client: redis.Redis) -> None:
    _deployment(client)
    console, buf = _console()
    rc = run_status(_args("--json"), SETTINGS, client=client, console=console)
    snap = json.loads(buf.getvalue())
    assert rc == 1  # stage 2 has no worker
    assert snap["orchestrators"] == 1
    assert snap["workers_per_stage"] == {"0": 1, "1": 1, "2": 0}
    by_name = {p["name"]: p for p in snap["processes"] if p["kind"] == "worker"}
    assert by_name["w0"]["host"] == "gpu-a" and by_name["w0"]["in_flight"] == 3
    assert 80 < by_name["w0"]["uptime_s"] < 600
    assert by_name["w1"]["pid"] == 42 and by_name["w1"]["completed"] is None
    assert by_name["w0"]["engine"] == {"running": 2, "waiting": 1, "capacity": 2}
    assert by_name["w1"]["engine"] is None
    assert 0 <= by_name["w0"]["last_beat_s"] <= keys.HEARTBEAT_TTL_S
    streams = {s["name"]: s for s in snap["streams"]}
    assert set(streams) >= {N.requests, N.stage_in(0), N.stage_in(2), N.client_out("c1")}
    (group,) = streams[N.stage_in(0)]["groups"]
    assert group["pending"] == 2 and group["consumers"] == 1 and group["oldest_pending_age_s"] >= 0
    assert streams[N.requests]["length"] == 5
    assert snap["request_rate_per_s"] == pytest.approx(5 / 60)


def test_status_once_prints_tables_and_warns(client: redis.Redis) -> None:
    _deployment(client)
    console, buf = _console()
    run_status(_args("--once"), SETTINGS, client=client, console=console)
    text = buf.getvalue()
    assert "gpu-a" in text and "stage:0:in" in text and "client:c1" in text
    assert "2+1/2" in text  # the async engine's batch: running+waiting/capacity
    assert "no live worker for stage 2" in text


def test_empty_namespace_is_unhealthy_not_an_error(client: redis.Redis) -> None:
    console, buf = _console()
    assert run_status(_args("--json"), SETTINGS, client=client, console=console) == 1
    assert json.loads(buf.getvalue())["orchestrators"] == 0


def test_an_empty_namespace_names_the_namespaces_that_run_on_this_redis(
    client: redis.Redis,
) -> None:
    """`serve` runs several pipelines each in `<ns>.<name>`: `status` of the plain one says so."""
    for namespace in ("omni.voice", "omni.speak", "other"):
        client.set(keys.Names(namespace).orchestrator_heartbeat(), "x", ex=keys.HEARTBEAT_TTL_S)
    console, buf = _console()
    assert run_status(_args("--json"), SETTINGS, client=client, console=console) == 1
    assert json.loads(buf.getvalue())["other_namespaces"] == ["omni.speak", "omni.voice", "other"]
    console, buf = _console()
    run_status(_args("--once"), SETTINGS, client=client, console=console)
    assert "on this Redis: omni.speak, omni.voice, other (--namespace)" in buf.getvalue()
    _deployment(client)  # something runs here: no other namespace is looked for
    console, buf = _console()
    run_status(_args("--json"), SETTINGS, client=client, console=console)
    assert json.loads(buf.getvalue())["other_namespaces"] == []


def test_each_orchestrator_process_has_its_row_and_the_shared_beat_names_the_pipeline(
    client: redis.Redis,
) -> None:
    beat = json.dumps({"pipeline": "voice", "mode": "streaming"})
    client.set(N.orchestrator_heartbeat(), beat, ex=keys.HEARTBEAT_TTL_S)
    client.set(N.epoch, "e" * 32)
    for token, pid in (("a" * 32, 7), ("b" * 32, 8)):
        doc = {"host": "cpu-a", "pid": pid, "started_at": time.time() - 60, "in_flight": pid}
        client.set(N.orchestrator_process_heartbeat(token), json.dumps(doc), ex=5)
    console, buf = _console()
    run_status(_args("--json"), SETTINGS, client=client, console=console)
    snap = json.loads(buf.getvalue())
    assert snap["orchestrators"] == 2 and snap["pipeline"] == {"name": "voice", "mode": "streaming"}
    rows = {p["name"]: p["pid"] for p in snap["processes"] if p["kind"] == "orchestrator"}
    assert rows == {None: None, "a" * 32: 7, "b" * 32: 8}  # the epoch token is no process
    console, buf = _console()
    run_status(_args("--once"), SETTINGS, client=client, console=console)
    text = buf.getvalue()
    assert "pipeline voice (streaming)" in text and "a" * 12 in text and "b" * 12 in text
    assert "a" * 13 not in text and "e" * 12 not in text


def test_each_orchestrator_is_counted_by_the_slot_leases_it_holds(redis_url: str) -> None:
    """Orchestrators share one heartbeat key; each holds its own slot's lease (and any it
    took over): status counts and lists them by those."""
    settings = Settings(redis_url=redis_url, namespace="status-slots")
    names = settings.names

    async def two_orchestrators() -> tuple[str, str]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            first = Leases(client, names, 30.0)  # a random token
            second = Leases(client, names, 30.0, "omni-orchestrator-7c9d5b8f6d-x2x4q")  # a pod's
            assert await first.take_lowest_free() == 0
            assert await second.take_lowest_free() == 1
            assert await first.take(2)  # a slot taken over
            return first.token, second.token
        finally:
            await client.aclose()

    first, second = asyncio.run(two_orchestrators())
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(names.orchestrator_heartbeat(), "omni", ex=keys.HEARTBEAT_TTL_S)
        console, buf = _console()
        run_status(_args("--json"), settings, client=client, console=console)
        snap = json.loads(buf.getvalue())
        assert snap["orchestrators"] == 2
        held = [(s["slot"], s["holder"]) for s in snap["orchestrator_slots"]]
        assert held == [(0, first), (1, second), (2, first)]
        assert all(0 < s["ttl_s"] <= 30 for s in snap["orchestrator_slots"])
        console, buf = _console()
        run_status(_args("--once"), settings, client=client, console=console)
        shown = buf.getvalue()
        assert "orchestrators 2" in shown and first[:12] in shown and first not in shown
        assert second in shown  # a given name whole, not cut to its first 12 characters
    finally:
        client.close()


def test_heartbeat_values_of_every_shape() -> None:
    assert parse_heartbeat(b"worker-1") == {"value": "worker-1"}
    assert parse_heartbeat(msgpack.packb({"pid": 1})) == {"pid": 1}
    doc = parse_heartbeat(heartbeat_value(in_flight=2, completed=3).encode())
    assert doc["in_flight"] == 2 and doc["completed"] == 3 and "host" in doc
    assert parse_heartbeat(b"{not json") == {"value": "{not json"}


def test_poller_fills_stream_gauges_and_publishes_stats(client: redis.Redis) -> None:
    _deployment(client)
    metrics = Metrics()
    metrics.observe("omni_e2e_request_latency_seconds", 0.2)
    StreamStatsPoller(client, N, metrics, "orchestrator", default_concurrency=256).poll_once()
    assert metrics.gauge("omni_stream_length", stream=N.requests) == 5
    pending = metrics.gauge("omni_stream_pending_entries", stream=N.stage_in(0), group="workers")
    assert pending == 2
    alive = {sid: metrics.gauge("omni_workers_alive", stage=sid) for sid in (0, 1, 2)}
    assert alive == {0: 1, 1: 1, 2: 0}
    console, buf = _console()
    run_status(_args("--json"), SETTINGS, client=client, console=console)
    stats = json.loads(buf.getvalue())["stats"]["orchestrator"]
    assert stats["latency"]["omni_e2e_request_latency_seconds"]["count"] == 1


def _dead_letter(r: redis.Redis, stream: str, raw: bytes, error: str = "bad entry") -> str:
    fields: dict[Any, Any] = {"stream": stream, "id": b"1-1", "error": error, "raw": raw}
    new_id: Any = r.xadd(N.dead_letters, fields)
    return str(new_id.decode())


def test_dead_letters_listed_newest_first(client: redis.Redis) -> None:
    first = _dead_letter(client, N.requests, b"a", "first")
    second = _dead_letter(client, N.stage_out(1), b"bb", "second")
    letters = list_dead_letters(client, N)
    assert [d.id for d in letters] == [second, first]
    assert letters[0].stream == N.stage_out(1) and letters[0].raw_bytes == 2
    console, buf = _console()
    run_dead_letters(_args("--json", adder=add_dead_letters_arguments), SETTINGS, client, console)
    assert [d["error"] for d in json.loads(buf.getvalue())] == ["second", "first"]
    console, buf = _console()
    run_dead_letters(_args(adder=add_dead_letters_arguments), SETTINGS, client, console)
    assert "2 dead letters" in buf.getvalue() and "stage:1:out" in buf.getvalue()


def test_dead_letters_name_their_requests_even_when_cut(client: redis.Redis) -> None:
    """What a client's error names (`X-Omni-Request-Id`), read from the payload's msgpack:
    a message, a batch of them, one cut at 4 KiB; bytes that are no message name none."""
    one = codec.encode_model(StageInputMsg(request_id="r-one", data="x" * 10_000))
    batch = msgpack.packb(
        [
            msgpack.unpackb(codec.encode_model(StageInputMsg(request_id=f"b{i}", data=i)))
            for i in range(5)
        ]
    )
    for raw in (one[:RAW_CUT_BYTES], batch, b"\xc1garbage"):
        _dead_letter(client, N.stage_in(0), raw)
    letters = list_dead_letters(client, N)
    assert [d.request_ids for d in letters] == [[], ["b0", "b1", "b2"], ["r-one"]]
    console, buf = _console()
    run_dead_letters(_args(adder=add_dead_letters_arguments), SETTINGS, client, console)
    assert "r-one" in buf.getvalue() and "b0, b1, b2" in buf.getvalue()


def test_replay_requeues_onto_the_original_stream_once(client: redis.Redis) -> None:
    dead_id = _dead_letter(client, N.requests, b"payload")
    console, buf = _console()
    args = _args("--replay", dead_id, adder=add_dead_letters_arguments)
    assert run_dead_letters(args, SETTINGS, client, console) == 0
    assert f"replayed {dead_id}" in buf.getvalue()
    entries: Any = client.xrange(N.requests)
    assert [e[1] for e in entries] == [{keys.PAYLOAD_FIELD.encode(): b"payload"}]
    assert client.xlen(N.dead_letters) == 0
    with pytest.raises(ConfigError, match="no dead letter"):
        replay(client, N, dead_id)


def test_replay_refuses_foreign_streams_and_cut_payloads(client: redis.Redis) -> None:
    foreign = _dead_letter(client, "other:requests", b"x")
    with pytest.raises(ConfigError, match="not one of this namespace"):
        replay(client, N, foreign)
    cut = _dead_letter(client, N.requests, b"x" * 4096)
    with pytest.raises(ConfigError, match="--force"):
        replay(client, N, cut)
    replay(client, N, cut, force=True)
    assert client.xlen(N.requests) == 1


def test_live_view_refreshes_and_survives_a_redis_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import omni_runtime.ops.status as status

    r = fakeredis.FakeRedis()
    _deployment(r)
    frames = {"n": 0}
    real_collect = status.collect_status

    looked_around: list[bool] = []

    def flaky(client: redis.Redis, names: keys.Names, look_around: bool) -> dict[str, Any]:
        frames["n"] += 1
        looked_around.append(look_around)
        if frames["n"] == 2:
            raise redis.ConnectionError("connection refused")
        return real_collect(client, names, look_around)

    def sleep(_s: float) -> None:
        if frames["n"] >= 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(status, "collect_status", flaky)
    monkeypatch.setattr(status, "time", SimpleNamespace(sleep=sleep))  # not the global one
    console, buf = _console()
    assert run_status(_args("--interval", "0.1"), SETTINGS, client=r, console=console) == 0
    assert frames["n"] == 3 and "gpu-a" in buf.getvalue()
    assert looked_around == [True, False, False]  # the keyspace is scanned once, not per frame


def test_status_says_when_redis_is_out_of_memory(full_redis: FullableRedis) -> None:
    """At maxmemory with noeviction Redis refuses writes: status says so, with the count of
    writes refused, and is unhealthy while it lasts."""
    client = redis.Redis.from_url(full_redis.url)
    try:
        _deployment(client)
        client.set(N.stage_heartbeat(2, "w2"), "{}", ex=keys.HEARTBEAT_TTL_S)
        console, buf = _console()
        assert run_status(_args("--json"), SETTINGS, client=client, console=console) == 0
        assert json.loads(buf.getvalue())["redis_memory"]["out_of_memory"] is False
        with full_redis.full():
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                client.set("x", 1)
            console, buf = _console()
            assert run_status(_args("--json"), SETTINGS, client=client, console=console) == 1
            memory = json.loads(buf.getvalue())["redis_memory"]
            assert memory["out_of_memory"] is True and memory["policy"] == "noeviction"
            assert memory["maxmemory_bytes"] == 1 and memory["oom_refusals"] >= 1
            console, buf = _console()
            run_status(_args("--once"), SETTINGS, client=client, console=console)
            assert "Redis is out of memory" in buf.getvalue()
    finally:
        client.close()
