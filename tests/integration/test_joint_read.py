"""One XREADGROUP for several streams (`redis_io/joint_read.py`): each member reader gets its
own stream's entries, in order, checked as a lone reader would check them; a member can
walk its backlog while the others read new entries; an interrupt ends every member's read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from omni_runtime.redis_io.joint_read import JointRead
from omni_runtime.redis_io.streams import GroupReader, ensure_group, entry_fields
from omni_runtime.redis_io.write_ops import xadd_fields
from omni_runtime.wire.messages import AbortMsg
from tests.fakes import GroupMakerFailingOnce
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(30)

STREAMS = ("out:0", "out:1", "out:2")


@pytest.fixture(params=["redis-server", "fakeredis"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    if request.param == "redis-server":
        c = aioredis.Redis.from_url(request.getfixturevalue("redis_url"))
    else:
        import fakeredis

        c = fakeredis.FakeAsyncRedis()
    try:
        yield c
    finally:
        await c.aclose()


class CountedJoint(JointRead):
    """Counts the XREADGROUPs it sends."""

    reads = 0

    async def _xreadgroup(self, *args: Any) -> Any:
        self.reads += 1
        return await super()._xreadgroup(*args)


async def members(
    client: aioredis.Redis, joint_class: type[CountedJoint] = CountedJoint
) -> tuple[CountedJoint, list[GroupReader[AbortMsg]]]:
    joint = joint_class(client, "g", "c")
    readers = []
    for stream in STREAMS:
        await ensure_group(client, stream, "g")
        reader = GroupReader(
            client, stream, "g", "c", AbortMsg, max_bytes=1 << 20, dead_letters="dead", joint=joint
        )
        readers.append(reader)
    return joint, readers


async def put(client: aioredis.Redis, stream: str, *rids: str) -> None:
    for rid in rids:
        await client.xadd(stream, xadd_fields(entry_fields(AbortMsg(request_id=rid))))


def ids(batch: list[tuple[bytes, AbortMsg]]) -> list[str]:
    return [msg.request_id for _entry, msg in batch]


async def read_some(reader: GroupReader[AbortMsg]) -> list[str]:
    """Read as a stage client does: again after a read that brought nothing for it."""
    while not (batch := await reader.read(10, 1000)):
        pass
    return ids(batch)


async def test_one_read_serves_every_member_in_its_streams_order(client: aioredis.Redis) -> None:
    joint, (r0, r1, r2) = await members(client)
    await put(client, "out:0", "a", "b", "c")
    await put(client, "out:2", "x", "y")
    assert ids(await r0.read(10, 1000)) == ["a", "b", "c"]
    assert ids(await r2.read(10, 1000)) == ["x", "y"]
    assert joint.reads == 2  # the (empty) backlogs, then one read brought both streams' entries
    reads = joint.reads
    blocked = asyncio.create_task(r1.read(10, 5000))
    await wait_for(lambda: r1.reading)
    await put(client, "out:1", "m")
    assert ids(await asyncio.wait_for(blocked, 5)) == ["m"]
    assert joint.reads == reads + 1


async def test_a_member_waiting_gets_what_another_members_read_brought(
    client: aioredis.Redis,
) -> None:
    _joint, (r0, r1, _r2) = await members(client)
    first = asyncio.create_task(read_some(r0))
    await wait_for(lambda: r0.reading and not r0.cursor.in_backlog)
    second = asyncio.create_task(read_some(r1))
    await put(client, "out:1", "for-r1")
    assert await asyncio.wait_for(second, 5) == ["for-r1"]
    await put(client, "out:0", "for-r0")
    assert await asyncio.wait_for(first, 5) == ["for-r0"]


async def test_a_member_walks_its_backlog_while_the_others_read_new_entries(
    client: aioredis.Redis,
) -> None:
    for stream in STREAMS:
        await ensure_group(client, stream, "g")
    await put(client, "out:0", "old")
    await client.xreadgroup("g", "c", {"out:0": ">"}, 10)  # read, never acknowledged
    _joint, (r0, r1, _r2) = await members(client)
    await put(client, "out:0", "new")
    await put(client, "out:1", "other")
    assert ids(await r0.read(10, 1000)) == ["old"]  # its backlog first
    assert ids(await r1.read(10, 1000)) == ["other"]
    assert ids(await r0.read(10, 1000)) == ["new"]
    assert not r0.cursor.in_backlog


async def test_malformed_and_trimmed_entries_are_handled_as_by_a_lone_reader(
    client: aioredis.Redis,
) -> None:
    _joint, (r0, _r1, _r2) = await members(client)
    await client.xadd("out:0", {"junk": b"1"})
    await put(client, "out:0", "good")
    await put(client, "out:1", "gone")
    got = await r0.read(10, 1000)
    assert ids(got) == ["good"]
    assert await client.xlen("dead") == 1
    entry = (await client.xpending_range("out:1", "g", "-", "+", 10))[0]["message_id"]
    await client.xdel("out:1", entry)  # read, then trimmed before being handled
    again = GroupReader(
        client, "out:1", "g", "c", AbortMsg, max_bytes=1 << 20, dead_letters="dead",
        joint=JointRead(client, "g", "c"),
    )  # fmt: skip
    assert await asyncio.wait_for(again.read(10, 200), 5) == []
    assert (await client.xpending("out:1", "g"))["pending"] == 0  # the trimmed one acked


async def test_interrupting_one_member_ends_every_members_read(client: aioredis.Redis) -> None:
    _joint, (r0, r1, r2) = await members(client)
    blocked = [asyncio.create_task(r.read(10, 10_000)) for r in (r0, r1)]
    await wait_for(lambda: r0.reading and not r0.cursor.in_backlog)
    r2.interrupt()
    assert await asyncio.wait_for(asyncio.gather(*blocked), 5) == [[], []]
    assert r0.interrupted and r1.interrupted
    await put(client, "out:0", "later")
    assert await r0.read(10, 1000) == []
    _next_joint, (after, _a1, _a2) = await members(client)  # the consumer's next holder
    assert ids(await after.read(10, 1000)) == ["later"]  # nothing lost


async def test_each_read_returns_to_its_caller_even_empty(client: aioredis.Redis) -> None:
    """A read ends within its block and hands back nothing: the caller checks its stop
    flag and lease fence before the next one (a deposed owner must not read on)."""
    joint, (r0, _r1, _r2) = await members(client)
    assert await asyncio.wait_for(r0.read(10, 50), 5) == []
    assert joint.reads == 2  # the backlogs, then one read blocked 50 ms


async def test_a_group_made_anew_while_redis_goes_away_again_is_a_failed_read(
    client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis came back empty (the group vanished), then failed again while the group was
    being made anew: the readers retry as after any failed read, none of them dies."""
    _joint, (r0, _r1, _r2) = await members(client)
    assert await r0.read(10, 50) == []  # backlogs walked, groups in use
    maker = GroupMakerFailingOnce()
    monkeypatch.setattr("omni_runtime.redis_io.streams.ensure_group", maker.ensure)
    await client.delete(*STREAMS)  # the groups vanish with their streams
    await put(client, "out:0", "lost-group")  # a new stream, without the group
    # Made anew from the stream's start: the entry written meanwhile is read, once.
    assert await asyncio.wait_for(read_some(r0), 10) == ["lost-group"]
    assert maker.failed
    await put(client, "out:0", "after")
    assert await asyncio.wait_for(read_some(r0), 10) == ["after"]


async def test_what_a_read_brought_is_handed_on_before_the_next_read_is_sent(
    client: aioredis.Redis,
) -> None:
    """Each member loops as a stage reader does (read, hand on to a queue, read again); one
    consumer of that queue stands for the dispatcher. Whichever member sends the next read,
    the consumer has handled the entries by then: a read sent first would make each light-
    load hop's routing wait for the packing and sending of that read."""
    events: list[str] = []

    class Logged(CountedJoint):
        async def _xreadgroup(self, *args: Any) -> Any:
            events.append("sent")
            reply = await super()._xreadgroup(*args)
            events.append("returned")
            return reply

    joint, readers = await members(client, Logged)
    handed: asyncio.Queue[str] = asyncio.Queue()

    async def member(reader: GroupReader[AbortMsg]) -> None:
        while True:
            for rid in ids(await reader.read(10, 200)):
                handed.put_nowait(rid)

    async def dispatcher() -> None:
        while True:
            events.append(f"handled {await handed.get()}")

    tasks = [asyncio.create_task(member(r)) for r in readers]
    tasks.append(asyncio.create_task(dispatcher()))
    try:
        for i, stream in enumerate(("out:1", "out:2", "out:0", "out:2")):
            await wait_for(lambda: joint.reading)
            await put(client, stream, f"x{i}")
            handled = f"handled x{i}"
            await wait_for(lambda: handled in events)  # noqa: B023 (awaited in the loop)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for i in range(4):  # between the read that brought it and its handling: no read sent
        reads = [e for e in events[: events.index(f"handled x{i}")] if e in ("sent", "returned")]
        assert reads[-1] == "returned", events
