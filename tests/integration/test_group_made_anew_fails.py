"""A consumer group that vanished (Redis came back empty) and cannot be made anew at once
(Redis went away again) is a failed read, retried with back-off: no reader dies of it.
The joint read has its own test (`test_joint_read.py`); these are the lone readers'."""

from __future__ import annotations

import time

import fakeredis
import pytest

from omni_runtime.redis_io.streams import (
    GroupReader,
    SyncGroupReader,
    ensure_group,
    ensure_group_sync,
    entry_fields,
)
from omni_runtime.redis_io.write_ops import xadd_fields
from omni_runtime.wire.messages import AbortMsg
from tests.fakes import GroupMakerFailingOnce

pytestmark = pytest.mark.timeout(30)

ENTRY = xadd_fields(entry_fields(AbortMsg(request_id="after")))


def test_a_worker_reader_survives_a_failed_group_re_creation(
    fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    ensure_group_sync(fake_redis, "in", "g")
    reader = SyncGroupReader(
        fake_redis, "in", "g", "c", AbortMsg, max_bytes=1 << 20, dead_letters="dead"
    )
    assert reader.read(10, 10) == []  # backlog walked
    maker = GroupMakerFailingOnce()
    monkeypatch.setattr("omni_runtime.redis_io.streams.ensure_group_sync", maker.ensure_sync)
    fake_redis.delete("in")
    fake_redis.xadd("in", ENTRY)  # the stream again, without its group
    end = time.monotonic() + 10
    while not (got := reader.read(10, 10)):
        assert time.monotonic() < end, "the reader never recovered"
    assert [m.request_id for _e, m in got] == ["after"] and maker.failed


async def test_a_lone_async_reader_survives_a_failed_group_re_creation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = fakeredis.FakeAsyncRedis()
    await ensure_group(client, "out", "g")
    reader = GroupReader(client, "out", "g", "c", AbortMsg, max_bytes=1 << 20, dead_letters="dead")
    reader.joint = None  # the path a Redis Cluster takes (each stream read alone)
    assert await reader.read(10, 10) == []
    maker = GroupMakerFailingOnce()
    monkeypatch.setattr("omni_runtime.redis_io.streams.ensure_group", maker.ensure)
    await client.delete("out")
    await client.xadd("out", ENTRY)
    end = time.monotonic() + 10
    while not (got := await reader.read(10, 10)):
        assert time.monotonic() < end, "the reader never recovered"
    assert [m.request_id for _e, m in got] == ["after"] and maker.failed
    await client.aclose()
