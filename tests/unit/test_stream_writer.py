"""StreamWriter: the order a batch is written in, and bounded, reported give-ups."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from omni_runtime import keys
from omni_runtime.errors import CodecError
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.start import Observability
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.entries import parse_entries, parse_entry
from omni_runtime.redis_io.packed_async import AsyncPackedPipe
from omni_runtime.redis_io.write_ops import (
    Expire,
    ExpireAt,
    HashDrop,
    HashPut,
    Op,
    XAck,
    XAdd,
    fill_pipeline,
    merged,
)
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import codec
from omni_runtime.worker.actions import Outgoing
from omni_runtime.worker.output_batch import pack_entries
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(30)


class RecordingPipe:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def xadd(self, stream: str, fields: Any, maxlen: int, approximate: bool) -> None:
        self.calls.append(("xadd", stream, maxlen))

    def xack(self, stream: str, group: str, *ids: bytes) -> None:
        self.calls.append(("xack", stream, group, *ids))

    def expire(self, key: str, ttl_s: int) -> None:
        self.calls.append(("expire", key, ttl_s))


def test_adds_urgent_ones_last_then_one_ack_per_stream_then_expires() -> None:
    """Urgent last: Redis answers the readers a pipeline wakes last-woken first."""
    pipe = RecordingPipe()
    fill_pipeline(
        pipe,
        [
            XAck("out", "g", b"1-0"),
            XAdd("client", {}, 10),
            Expire("client", 5),
            XAdd("in", {}, 20, urgent=True),
            XAck("out", "g", b"2-0"),
            Expire("client", 9),
            XAdd("client", {}, 10),
        ],
    )
    assert pipe.calls == [
        ("xadd", "client", 10),
        ("xadd", "client", 10),
        ("xadd", "in", 20),
        ("xack", "out", "g", b"1-0", b"2-0"),
        ("expire", "client", 9),
    ]


def test_urgent_entries_keep_their_order_so_the_last_queued_is_answered_first() -> None:
    """A streaming request's inputs are queued downstream first: stage 0's goes last."""
    pipe = RecordingPipe()
    fill_pipeline(
        pipe,
        [
            XAdd("in2", {}, 1, urgent=True),
            XAdd("client", {}, 2),
            XAdd("in1", {}, 3, urgent=True),
            XAdd("in0", {}, 4, urgent=True),
        ],
    )
    assert [call[1] for call in pipe.calls] == ["client", "in2", "in1", "in0"]


async def test_batch_is_written_and_callers_told(fake_server: fakeredis.FakeServer) -> None:
    client = fakeredis.FakeAsyncRedis(server=fake_server)
    writer = StreamWriter(client, 100)
    task = asyncio.create_task(writer.run())
    try:
        writer.xadd("s", {"m": b"1"}, urgent=True)
        writer.expire("s", 60)
        assert await writer.written()
        assert await client.xlen("s") == 1 and 0 < await client.ttl("s") <= 60
        assert writer.dropped_writes == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


async def test_writes_are_given_up_after_bounded_attempts_counted_and_reported() -> None:
    class DownPool:
        async def get_connection(self) -> Any:
            raise RedisConnectionError("down")

    class Down:
        connection_pool = DownPool()

    metrics = Metrics()
    writer = StreamWriter(Down(), 100, obs=Observability(metrics), backoff=Backoff(0.001, 0.002, 3))  # type: ignore[arg-type]
    task = asyncio.create_task(writer.run())
    try:
        writer.xadd("a", {"m": b"1"})
        writer.xack("b", "g", b"1-0")
        assert await writer.written() is False
        await writer.flushed()
        assert writer.dropped_writes == 2
        assert metrics.value("omni_dropped_writes_total", stream="a") == 1
        assert metrics.value("omni_retries_total", source="writer") == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_cancelled_writer_drops_what_is_queued_and_keeps_nobody_waiting() -> None:
    """Cancelled with every task (asyncio.run on Ctrl-C), it will never write again: what
    was queued, and what is queued later, is dropped and counted; nobody waits for it."""

    class Never:
        class connection_pool:
            @staticmethod
            async def get_connection() -> Any:
                await asyncio.Event().wait()  # a round trip that never ends

    writer = StreamWriter(Never(), 100)  # type: ignore[arg-type]
    task = asyncio.create_task(writer.run())
    writer.xadd("a", {"m": b"1"})
    in_flight = asyncio.create_task(writer.written())
    await wait_for(lambda: writer._in_flight is not None)  # taken: stuck on its connection
    writer.xadd("b", {"m": b"2"})
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    async with asyncio.timeout(1):
        assert await in_flight is False
        await writer.flushed()
        assert await writer.written() is False
    writer.expire("c", 5)
    assert writer.dropped_writes == 2  # "b", then "c"; "a" left, whether written unknown


async def test_an_add_with_a_max_age_trims_older_entries(fake_server: fakeredis.FakeServer) -> None:
    """The control stream is read by every worker and acknowledged by none: trimmed by age."""
    client = fakeredis.FakeAsyncRedis(server=fake_server)
    await client.xadd("control", {"m": b"ancient"}, id="1000-0")
    writer = StreamWriter(client, 100)
    task = asyncio.create_task(writer.run())
    try:
        writer.xadd("control", {"m": b"new"}, max_age_s=60.0)
        await writer.written()
        entries: Any = await client.xrange("control")
        assert [fields[b"m"] for _id, fields in entries] == [b"new"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


def test_mergeable_adds_share_an_entry_per_stream_in_order_up_to_the_byte_limit() -> None:
    def out(stream: str, i: int, limit: int = 1 << 20) -> XAdd:
        msg = {"type": "orch_output", "i": i, "pad": "x" * 40}
        return XAdd(stream, {keys.PAYLOAD_FIELD: codec.encode(msg)}, 10, merge_up_to=limit)

    plain = XAdd("stage", {keys.PAYLOAD_FIELD: codec.encode({"type": "t"})}, 10)
    adds = merged([out("a", 0), plain, out("b", 1), out("a", 2), out("a", 3)])
    assert [a.stream for a in adds] == ["a", "stage", "b"]
    assert [m["i"] for m in parse_entries(_fields(adds[0]), dict, 1 << 20)] == [0, 2, 3]
    assert [m["i"] for m in parse_entries(_fields(adds[2]), dict, 1 << 20)] == [1]
    assert adds[1] is plain
    one = len(out("c", 0).fields[keys.PAYLOAD_FIELD])
    limit = 2 * one + codec.BATCH_HEADER_BYTES  # two fit in a batch, the third starts another
    small = merged([out("c", i, limit) for i in range(5)])
    sizes = [len(parse_entries(_fields(a), dict, limit)) for a in small]
    assert sizes == [2, 2, 1]
    assert all(len(a.fields[keys.PAYLOAD_FIELD]) <= limit for a in small)


def test_a_burst_of_big_outputs_is_batched_in_bounded_entries_by_both_writers() -> None:
    """However high the message limit, a batch is at most `codec.BATCH_MAX_BYTES`: a
    burst of answers' audio is many entries of that size, not one of megabytes."""
    payload = codec.encode({"type": "orch_output", "pad": b"\0" * 7_500})
    n = 10 * codec.BATCH_MAX_BYTES // len(payload)
    adds = merged([XAdd("c", {keys.PAYLOAD_FIELD: payload}, 10, merge_up_to=64 << 20)] * n)
    entries = pack_entries(
        "s", [Outgoing("r", 0, payload, ends=False, is_error=False)] * n, 64 << 20
    )
    for got in ([a.fields[keys.PAYLOAD_FIELD] for a in adds], [e.payload for e in entries]):
        assert 10 <= len(got) <= 11
        assert all(len(p) <= codec.BATCH_MAX_BYTES for p in got)
        assert sum(len(parse_entries({b"m": p}, dict, 1 << 20)) for p in got) == n


def test_a_batch_of_messages_is_refused_where_one_message_is_expected() -> None:
    batch = codec.encode_batch([codec.encode({"type": "x"})] * 2)
    with pytest.raises(CodecError, match="batch"):
        parse_entry({keys.PAYLOAD_FIELD.encode(): batch}, dict, 1 << 20)
    with pytest.raises(CodecError, match="'type'"):
        parse_entries({keys.PAYLOAD_FIELD.encode(): codec.encode_batch([b"\x01"])}, dict, 99)


def _fields(add: XAdd) -> dict[bytes, bytes]:
    return {k.encode(): v for k, v in add.fields.items()}


async def test_the_packed_pipe_sends_what_redis_pys_pipeline_would() -> None:
    """Same ops, same commands: the hand-packed round trip is only a cheaper way to send them."""
    ops: list[Op] = [
        XAdd("s", {"p": b"x"}, 100),
        XAdd("in", {"p": b"y"}, 50, urgent=True),
        XAdd("control", {"p": b"z"}, 100, max_age_s=60.0),
        HashPut("states", {"r1": b"a", "r2": b"b"}),
        HashDrop("states", ["r3"]),
        ExpireAt("states", 123_456),
        ExpireAt("other", None),
        XAck("out", "g", b"1-0", delete=True),
        Expire("s", 30),
    ]
    client = aioredis.Redis()  # never connects: only its pipeline's command stack is read
    packed = AsyncPackedPipe(client)
    fill_pipeline(packed, ops)
    pipe = client.pipeline(transaction=False)
    fill_pipeline(pipe, ops)
    theirs = [args for args, _options in pipe.command_stack]
    ours = packed.commands
    minid = [i for i, cmd in enumerate(ours) if "MINID" in cmd]  # a clock read on each side
    for i in minid:
        assert abs(int(ours[i][3]) - int(theirs[i][3])) < 1000  # ms
        ours[i], theirs[i] = ours[i][:3] + ours[i][4:], theirs[i][:3] + theirs[i][4:]
    assert minid and [wire(c) for c in ours] == [wire(c) for c in theirs]


def wire(command: tuple[Any, ...]) -> list[bytes]:
    """Each argument as the bytes Redis receives."""
    return [a if isinstance(a, bytes) else str(a).encode() for a in command]
