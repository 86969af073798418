"""The control-plane reader kit on fakeredis: backlog first, strict entries, one dead-letter path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import fakeredis
import pytest
from pydantic import TypeAdapter
from redis.exceptions import ConnectionError as RedisConnectionError

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.streams import (
    GroupReader,
    SyncDeadLetters,
    SyncGroupReader,
    ensure_group,
    ensure_group_sync,
    entry_fields,
)
from omni_runtime.wire import codec
from omni_runtime.wire.messages import AbortMsg, ClientCommand, RequestMsg, StageOutputMsg

pytestmark = pytest.mark.timeout(30)

STREAM, GROUP, DEAD = "t:out", "g", "t:dead"
FAST = Backoff(0.001, 0.002, 3)


def out(rid: str, seq: int = 0) -> StageOutputMsg:
    return StageOutputMsg(request_id=rid, data=rid, finished=False, seq=seq)


@pytest.fixture
def client(fake_redis: fakeredis.FakeRedis) -> Iterator[fakeredis.FakeRedis]:
    ensure_group_sync(fake_redis, STREAM, GROUP)
    yield fake_redis


def sync_reader(client: Any, metrics: Metrics, consumer: str = "c") -> SyncGroupReader[Any]:
    return SyncGroupReader(
        client, STREAM, GROUP, consumer, StageOutputMsg, max_bytes=1 << 20,
        dead_letters=DEAD, metrics=metrics, backoff=FAST,
    )  # fmt: skip


def test_reads_valid_entries_in_order(client: fakeredis.FakeRedis) -> None:
    for i in range(3):
        client.xadd(STREAM, entry_fields(out(f"r{i}")))  # type: ignore[arg-type]
    reader = sync_reader(client, Metrics())
    got = reader.read(10, 10)
    assert [m.request_id for _id, m in got] == ["r0", "r1", "r2"]
    assert reader.cursor.next_id == ">"  # the empty backlog was walked first
    assert reader.ack(*(eid for eid, _m in got))
    assert client.xpending(STREAM, GROUP)["pending"] == 0


def test_backlog_of_the_same_consumer_comes_back_first(client: fakeredis.FakeRedis) -> None:
    for i in range(3):
        client.xadd(STREAM, entry_fields(out(f"r{i}")))  # type: ignore[arg-type]
    first = sync_reader(client, Metrics())
    assert len(first.read(2, 10)) == 2  # read, never acknowledged: the process "died"
    client.xadd(STREAM, entry_fields(out("r3")))  # type: ignore[arg-type]
    again = sync_reader(client, Metrics())
    seen = [m.request_id for _ in range(4) for _id, m in again.read(2, 10)]
    assert seen == ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"x": b"1"}, "exactly the field"),
        ({keys.PAYLOAD_FIELD: b"\xc1"}, "malformed"),
        ({keys.PAYLOAD_FIELD: codec.encode({"request_id": "r"})}, "'type'"),
        ({keys.PAYLOAD_FIELD: codec.encode({"type": "stage_output", "request_id": 7})}, "invalid"),
        ({keys.PAYLOAD_FIELD: b"x", "extra": b"y"}, "exactly the field"),
    ],
)
def test_malformed_entry_is_dead_lettered_acked_and_counted(
    client: fakeredis.FakeRedis, fields: dict[str, bytes], why: str
) -> None:
    bad = client.xadd(STREAM, fields)  # type: ignore[arg-type]
    client.xadd(STREAM, entry_fields(out("ok")))  # type: ignore[arg-type]
    metrics = Metrics()
    got = sync_reader(client, metrics).read(10, 10)
    assert [m.request_id for _id, m in got] == ["ok"]
    [(_did, dead)] = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(DEAD))
    assert dead[b"stream"] == STREAM.encode() and dead[b"id"] == bad
    assert why in dead[b"error"].decode()
    pending = client.xpending_range(STREAM, GROUP, min="-", max="+", count=10)
    assert [row["message_id"] for row in pending] == [got[0][0]]  # the bad one was acked
    assert metrics.value("omni_malformed_entries_total", stream=STREAM) == 1
    assert metrics.value("omni_dead_letters_total", stream=STREAM) == 1


def test_trimmed_pending_entry_is_acked_not_returned(client: fakeredis.FakeRedis) -> None:
    eid = client.xadd(STREAM, entry_fields(out("gone")))  # type: ignore[arg-type]
    assert len(sync_reader(client, Metrics()).read(10, 10)) == 1
    client.xdel(STREAM, eid)
    assert sync_reader(client, Metrics()).read(10, 10) == []
    assert client.xpending(STREAM, GROUP)["pending"] == 0


def test_vanished_group_is_recreated_from_id_0(client: fakeredis.FakeRedis) -> None:
    client.xadd(STREAM, entry_fields(out("r")))  # type: ignore[arg-type]
    client.xgroup_destroy(STREAM, GROUP)
    reader = sync_reader(client, Metrics())
    assert reader.read(10, 10) == []  # NOGROUP: recreated
    assert [m.request_id for _id, m in reader.read(10, 10)] == ["r"]


def test_read_failure_backs_off_and_returns_empty() -> None:
    class Down:
        def xreadgroup(self, *_a: Any, **_k: Any) -> Any:
            raise RedisConnectionError("down")

    metrics = Metrics()
    reader = sync_reader(Down(), metrics)
    assert reader.read(10, 10) == [] and reader.read(10, 10) == []
    assert metrics.value("omni_retries_total", stream=STREAM) == 2


def test_dead_letter_write_gives_up_after_bounded_attempts() -> None:
    class Down:
        def pipeline(self, **_k: Any) -> Any:
            raise RedisConnectionError("down")

    metrics = Metrics()
    dead = SyncDeadLetters(Down(), DEAD, metrics=metrics, backoff=FAST)  # type: ignore[arg-type]
    assert not dead.send(STREAM, GROUP, b"1-0", "bad", {b"m": b"x"})
    assert metrics.value("omni_dropped_writes_total", stream=STREAM) == 1
    assert metrics.value("omni_dead_letters_total") == 0


async def test_async_reader_takes_a_union_and_dead_letters(
    fake_server: fakeredis.FakeServer,
) -> None:
    client = fakeredis.FakeAsyncRedis(server=fake_server)
    try:
        await ensure_group(client, STREAM, GROUP)
        await ensure_group(client, STREAM, GROUP)  # BUSYGROUP is fine
        await client.xadd(STREAM, entry_fields(AbortMsg(request_id="a")))  # type: ignore[arg-type]
        await client.xadd(STREAM, {"m": codec.encode({"type": "nope"})})
        req = RequestMsg(request_id="r", client_id="c", prompt="hi")
        await client.xadd(STREAM, entry_fields(req))  # type: ignore[arg-type]
        metrics = Metrics()
        reader: GroupReader[RequestMsg | AbortMsg] = GroupReader(
            client, STREAM, GROUP, "c", TypeAdapter(ClientCommand), max_bytes=1 << 20,
            dead_letters=DEAD, metrics=metrics, backoff=FAST,
        )  # fmt: skip
        got = await reader.read(10, 10)
        assert [type(m) for _id, m in got] == [AbortMsg, RequestMsg]
        assert reader.read_ns > 0
        assert await reader.ack(*(eid for eid, _m in got))
        assert (await client.xpending(STREAM, GROUP))["pending"] == 0
        assert await client.xlen(DEAD) == 1
        assert metrics.value("omni_dead_letters_total", stream=STREAM) == 1
    finally:
        await client.aclose()
