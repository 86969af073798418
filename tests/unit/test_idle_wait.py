"""`IdleWait`: a request's outputs are waited for under one lazily re-armed timer."""

from __future__ import annotations

import asyncio
import time

import pytest

from omni_runtime.client.inbox import IdleWait, Pending
from omni_runtime.core.types import OrchOutput

pytestmark = pytest.mark.timeout(30)


def output(i: int, finished: bool = False) -> OrchOutput:
    return OrchOutput("r", 0, i, finished)


async def test_nothing_coming_ends_the_wait_after_the_timeout() -> None:
    waiter = IdleWait(Pending(), 0.1)
    t0 = time.monotonic()
    assert await asyncio.wait_for(waiter.next(), 10) is None
    assert time.monotonic() - t0 >= 0.1
    waiter.close()


async def test_outputs_arriving_in_time_keep_the_request_alive() -> None:
    pending = Pending()
    waiter = IdleWait(pending, 0.5)
    n = 60

    async def produce() -> None:
        for i in range(n):  # ~1.2 s in all: over two timeouts' worth, never near 0.5 s apart
            await asyncio.sleep(0.02)  # the scenario: an output every 20 ms, not a wait
            pending.queue.put_nowait(output(i, finished=i == n - 1))

    producer = asyncio.create_task(produce())
    t0 = time.monotonic()
    got = [await asyncio.wait_for(waiter.next(), 10) for _ in range(n)]
    waiter.close()
    await producer
    assert time.monotonic() - t0 > 1.0  # the timeout's span was passed, more than once
    assert [o.data for o in got if o is not None] == list(range(n))


async def test_time_the_consumer_spends_between_outputs_does_not_count() -> None:
    pending = Pending()
    for i in range(3):
        pending.queue.put_nowait(output(i))
    waiter = IdleWait(pending, 0.1)
    got = []
    for _ in range(3):
        got.append(await waiter.next())
        await asyncio.sleep(0.25)  # busy with it for longer than the timeout
    assert [o.data for o in got if o is not None] == [0, 1, 2]
    assert await asyncio.wait_for(waiter.next(), 10) is None  # then nothing more: it ends
    waiter.close()


async def test_an_output_on_its_way_is_not_overtaken_by_the_timeout() -> None:
    pending = Pending()
    waiter = IdleWait(pending, 0.1)
    waiter._since = asyncio.get_running_loop().time() - 1.0  # waiting for long already ...
    pending.queue.put_nowait(output(7))  # ... and its output just came, not yet taken
    waiter._check()
    waiter._since = None
    assert pending.queue.qsize() == 1
    assert await waiter.next() == output(7)
    waiter.close()


async def test_close_stops_the_timer() -> None:
    pending = Pending()
    waiter = IdleWait(pending, 0.05)
    waiter._since = asyncio.get_running_loop().time() - 1.0  # overdue, were it still armed
    waiter.close()
    assert waiter._timer.cancelled()
    assert pending.queue.empty()
