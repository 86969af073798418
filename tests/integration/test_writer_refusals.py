"""The stream writer against a Redis that refuses commands: out of memory, or for good.

Redis answers every command of a pipeline on its own and runs the rest around a refused
one, so the writer writes again only what was refused: an entry sent twice would be two
entries. Refused for memory, a write is held and written once Redis has room, in order
with the writes of its request after it; acknowledgements and deletions (never refused)
go at once. Refused for good, it fails the request it belongs to, alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from omni_runtime import keys
from omni_runtime.errors import OOM_MESSAGE, RedisOutOfMemoryError, TransportError
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.start import Observability
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.entries import parse_entries
from omni_runtime.redis_io.packed_async import AsyncPackedPipe
from omni_runtime.redis_io.write_ops import ExpireAt, HashPut
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import codec
from tests.redis_full import FullableRedis
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

PAYLOAD = keys.PAYLOAD_FIELD


class Failed(list[tuple[str, TransportError]]):
    """What `on_failed` was told, request by request."""

    def __call__(self, request_ids: list[str], error: TransportError) -> None:
        self.extend((rid, error) for rid in request_ids)


@pytest.fixture
async def client(full_redis: FullableRedis) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(full_redis.url)
    try:
        yield c
    finally:
        await c.aclose()


async def running(writer: StreamWriter) -> asyncio.Task[None]:
    task = asyncio.create_task(writer.run())
    writer.xadd("warm", {PAYLOAD: b"0"})
    assert await writer.written()  # holds its connection from here on
    return task


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def output(rid: str, seq: int) -> dict[str, bytes]:
    return {PAYLOAD: codec.encode({"type": "orch_output", "request_id": rid, "seq": seq})}


def stream_outputs(probe: redis.Redis, stream: str) -> list[tuple[str, int]]:
    """Each message of the stream, batches unpacked, in order."""
    entries: Any = probe.xrange(stream)
    out = []
    for _id, fields in entries:
        for msg in parse_entries(fields, dict, 1 << 20):
            out.append((msg["request_id"], msg["seq"]))
    return out


async def test_only_what_redis_refused_for_memory_is_written_again_and_once(
    full_redis: FullableRedis, client: aioredis.Redis
) -> None:
    probe = redis.Redis.from_url(full_redis.url)
    probe.xgroup_create("in", "g", id="0", mkstream=True)
    entry: Any = probe.xadd("in", {PAYLOAD: b"handled"})
    probe.xreadgroup("g", "c", {"in": ">"})
    metrics = Metrics()
    writer = StreamWriter(client, 100, obs=Observability(metrics))
    task = await running(writer)
    try:
        with full_redis.full():
            writer.xadd("out", output("r1", 0), owner="r1")
            writer.queue(HashPut("states", {"r1": b"state"}))
            writer.xack("in", "g", entry, delete=True)
            assert await writer.written() is False  # held, not written
            assert probe.xlen("in") == 0 and probe.xpending("in", "g")["pending"] == 0
            assert probe.xlen("out") == 0 and probe.hlen("states") == 0
            assert (writer.out_of_memory or "").startswith(OOM_MESSAGE)
            assert metrics.value("omni_redis_oom_refusals_total", source="writer") >= 1
        await wait_for(lambda: probe.hget("states", "r1") == b"state", deadline_s=10)
        await writer.flushed()  # nothing held any more
        assert stream_outputs(probe, "out") == [("r1", 0)]  # written once
        assert writer.out_of_memory is None and writer.dropped_writes == 0
    finally:
        await stop(task)
        probe.close()


async def test_a_requests_later_outputs_wait_behind_its_refused_one(
    full_redis: FullableRedis, client: aioredis.Redis
) -> None:
    """Client outputs of one round trip share an entry; refused, each request's are written
    again as an entry of their own, in order, the later ones after them."""
    probe = redis.Redis.from_url(full_redis.url)
    writer = StreamWriter(client, 100)
    task = await running(writer)
    try:
        with full_redis.full():
            writer.xadd("client", output("a", 0), merge_up_to=1 << 20, owner="a")
            writer.xadd("client", output("b", 0), merge_up_to=1 << 20, owner="b")
            assert await writer.written() is False
            writer.xadd("client", output("a", 1), merge_up_to=1 << 20, owner="a")
            writer.xadd("client", output("a", 2), merge_up_to=1 << 20, owner="a")
            await writer.written()
        await wait_for(lambda: probe.xlen("client") > 0, deadline_s=10)
        await writer.flushed()
        got = stream_outputs(probe, "client")
        assert sorted(got) == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
        assert [seq for rid, seq in got if rid == "a"] == [0, 1, 2]
    finally:
        await stop(task)
        probe.close()


async def test_a_write_refused_for_good_fails_its_request_alone_and_is_not_retried(
    full_redis: FullableRedis, client: aioredis.Redis
) -> None:
    """An expiry out of Redis's range: the rest of the batch is written, the request it
    belongs to is told, nothing is retried, and the next batch goes out at once."""
    probe = redis.Redis.from_url(full_redis.url)
    probe.hset("states", "bad", b"x")
    metrics, failed = Metrics(), Failed()
    writer = StreamWriter(client, 100, obs=Observability(metrics), on_failed=failed)
    task = await running(writer)
    try:
        writer.queue(ExpireAt("states", 2**63, owner="bad"))
        writer.xadd("s", output("good", 0), owner="good")
        assert await writer.written() is False
        assert [rid for rid, _e in failed] == ["bad"]
        assert "Redis refused a write" in str(failed[0][1])
        assert probe.xlen("s") == 1
        writer.xadd("s", output("next", 0), owner="next")
        async with asyncio.timeout(2):
            assert await writer.written()
        assert probe.xlen("s") == 2
        assert metrics.value("omni_retries_total", source="writer") == 0
    finally:
        await stop(task)
        probe.close()


async def test_a_client_writer_fails_a_write_refused_for_memory_at_once(
    full_redis: FullableRedis, client: aioredis.Redis
) -> None:
    """A refused submission is answered at once and never written behind its caller."""
    probe = redis.Redis.from_url(full_redis.url)
    failed = Failed()
    writer = StreamWriter(client, 100, hold_refused=False, on_failed=failed)
    task = await running(writer)
    try:
        with full_redis.full():
            writer.xadd("requests", output("r", 0), owner="r")
            async with asyncio.timeout(1):
                assert await writer.written() is False
        assert [rid for rid, _e in failed] == ["r"]
        assert isinstance(failed[0][1], RedisOutOfMemoryError)
        assert str(failed[0][1]).startswith(OOM_MESSAGE)
        await writer.flushed()
        assert probe.xlen("requests") == 0
    finally:
        await stop(task)
        probe.close()


async def test_writes_held_for_memory_are_given_up_after_the_retry_budget(
    full_redis: FullableRedis, client: aioredis.Redis
) -> None:
    failed = Failed()
    writer = StreamWriter(client, 100, backoff=Backoff(0.001, 0.002, 3), on_failed=failed)
    task = await running(writer)
    try:
        with full_redis.full():
            writer.xadd("out", output("r", 0), owner="r")
            writer.xadd("out", output("r", 1), owner="r")
            await writer.written()
            await wait_for(lambda: bool(failed), deadline_s=10)
            async with asyncio.timeout(5):
                await writer.flushed()
        assert {rid for rid, _e in failed} == {"r"}
        assert all(isinstance(e, RedisOutOfMemoryError) for _rid, e in failed)
        assert writer.dropped_writes == 2
    finally:
        await stop(task)


async def test_the_packed_pipe_reads_every_reply_past_an_error_reply(
    client: aioredis.Redis,
) -> None:
    """Read whole, the connection stays in step: the next round trip on it is answered."""
    await client.set("text", "not a stream")
    conn: Any = await client.connection_pool.get_connection()
    try:
        pipe = AsyncPackedPipe(client)
        pipe.xadd("text", {PAYLOAD: b"x"}, maxlen=10)
        pipe.xadd("s", {PAYLOAD: b"y"}, maxlen=10)
        replies = await pipe.execute(conn, raise_on_error=False)
        assert isinstance(replies[0], redis.exceptions.ResponseError)
        assert "WRONGTYPE" in str(replies[0]) and isinstance(replies[1], bytes)
        again = AsyncPackedPipe(client)
        again.xadd("text", {PAYLOAD: b"x"}, maxlen=10)
        again.xadd("s", {PAYLOAD: b"z"}, maxlen=10)
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):  # the first
            await again.execute(conn)
        assert await client.xlen("s") == 2  # run all the same, and the connection is in step
        last = AsyncPackedPipe(client)
        last.expire("s", 60)
        assert await last.execute(conn) == [1]
    finally:
        await client.connection_pool.release(conn)
