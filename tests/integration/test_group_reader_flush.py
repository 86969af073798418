"""A group reader blocked on a stream that Redis loses (FLUSHALL) recreates its group and
goes on reading, instead of dying on the UNBLOCKED error."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from omni_runtime.redis_io.streams import GroupReader, ensure_group, entry_fields
from omni_runtime.redis_io.write_ops import xadd_fields
from omni_runtime.wire.messages import AbortMsg
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(30)


async def test_a_reader_blocked_on_a_flushed_stream_recreates_its_group(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    other = aioredis.Redis.from_url(redis_url)
    try:
        await ensure_group(client, "s", "g")
        reader = GroupReader(
            client, "s", "g", "c", AbortMsg, max_bytes=1 << 20, dead_letters="dead"
        )
        assert await reader.read(10, 10) == []  # backlog walked: now blocking on ">"
        blocked = asyncio.create_task(reader.read(10, 5000))
        probe = redis.Redis.from_url(redis_url)
        await wait_for(lambda: int(probe.info("clients")["blocked_clients"]) > 0)
        probe.close()
        await other.flushall()
        assert await blocked == []
        await other.xadd("s", xadd_fields(entry_fields(AbortMsg(request_id="r"))))
        got = await reader.read(10, 1000)
        assert [m.request_id for _id, m in got] == ["r"]
    finally:
        await client.aclose()
        await other.aclose()
