"""`StreamWriter.send_now`: with no batch on its way, what a step queued (a stage's next
input, a client's output) leaves from the caller's own step, before the writer task's
turn; never past the fence."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis

from omni_runtime.redis_io.clients import async_client
from omni_runtime.redis_io.writer import StreamWriter
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def writer(redis_url: str) -> AsyncIterator[StreamWriter]:
    client = async_client(redis_url)
    w = StreamWriter(client, 100)
    task = asyncio.create_task(w.run())
    try:
        w.xadd("warm", {"m": b"0"})
        assert await w.written()  # the writer holds its connection from now on
        yield w
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


async def test_an_urgent_entry_goes_out_from_the_callers_step(
    writer: StreamWriter, redis_url: str
) -> None:
    probe = redis.Redis.from_url(redis_url)
    writer.xadd("in", {"m": b"1"}, urgent=True)
    writer.send_now()
    # No await from here on: the writer task gets no turn, yet the entry reaches Redis.
    wait_until(lambda: probe.xlen("in") == 1, 5)
    assert await writer.written()
    assert probe.xlen("in") == 1  # once: the writer task only read the replies
    probe.close()


async def test_any_write_a_step_queued_goes_out_from_it(
    writer: StreamWriter, redis_url: str
) -> None:
    """A client's output is not urgent (a hop's input is answered before it in a batch), but with
    no batch on its way it need not wait for the writer task's turn either."""
    probe = redis.Redis.from_url(redis_url)
    writer.xadd("client", {"m": b"1"})
    writer.send_now()
    wait_until(lambda: probe.xlen("client") == 1, 5)
    assert await writer.written()
    assert probe.xlen("client") == 1
    probe.close()


class LostLease:
    """The fence of a process that lost its lease: never fresh again."""

    def fresh(self) -> bool:
        return False

    async def hold(self) -> bool:
        return False


async def test_a_deposed_writer_sends_nothing_at_once_nor_later(
    writer: StreamWriter, redis_url: str
) -> None:
    probe = redis.Redis.from_url(redis_url)
    writer.fence = LostLease()
    writer.xadd("in", {"m": b"1"}, urgent=True)
    writer.send_now()
    assert await writer.written() is False
    assert probe.xlen("in") == 0
    assert writer.dropped_writes == 1
    probe.close()


class Switch:
    """A fence that holds until told otherwise."""

    def __init__(self) -> None:
        self.ok = True

    def fresh(self) -> bool:
        return self.ok

    async def hold(self) -> bool:
        return self.ok


async def test_a_batch_sent_ahead_whose_reply_is_lost_is_not_written_again_once_deposed(
    writer: StreamWriter, redis_url: str
) -> None:
    """Sent at once, then the process stalls: its lease lapses, the connection is closed
    by the slot's new holder before Redis ran the batch. On waking, the writer must not
    write that batch again."""
    probe = redis.Redis.from_url(redis_url)
    fence = Switch()
    writer.fence = fence
    probe.client_pause(10_000, all=False)  # writes wait in Redis, unrun
    try:
        writer.xadd("in", {"m": b"1"}, urgent=True)
        writer.send_now()
        probe.client_kill_filter(_type="normal", skipme=True)  # the batch dies unrun
        fence.ok = False  # and the lease is lost meanwhile
    finally:
        probe.client_unpause()
    assert await writer.written() is False
    assert probe.xlen("in") == 0
    assert writer.dropped_writes == 1
    probe.close()
