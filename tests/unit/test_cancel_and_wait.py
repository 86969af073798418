"""`cancel_and_wait` ends a task that swallows a cancellation, as redis-py's asyncio client
sometimes does mid-command, and gives up on one that never ends, within its deadline."""

from __future__ import annotations

import asyncio

import pytest

from omni_runtime.core.tasks import cancel_and_wait

pytestmark = pytest.mark.timeout(30)


async def test_a_task_that_swallows_one_cancellation_is_cancelled_again_until_it_ends() -> None:
    swallowed = 0
    running = asyncio.Event()

    async def stubborn() -> None:
        nonlocal swallowed
        running.set()
        while True:
            try:
                await asyncio.Event().wait()  # a command that never answers
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed < 3:
                    continue  # as a library catching it mid-command would
                raise

    task = asyncio.create_task(stubborn())
    await running.wait()
    assert await cancel_and_wait([task], timeout_s=5) == set()
    assert task.cancelled()
    assert swallowed == 3


async def test_a_task_that_never_ends_is_returned_once_the_deadline_passed() -> None:
    deaf = True
    running = asyncio.Event()

    async def ignores_cancels() -> None:
        running.set()
        while deaf:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(ignores_cancels())
    await running.wait()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await cancel_and_wait([task], timeout_s=0.3) == {task}
    assert 0.3 <= loop.time() - started < 3
    deaf = False  # it ends at its next cancel: the test leaves nothing running
    task.cancel()
    await asyncio.wait([task], timeout=5)
    assert task.done()


async def test_what_an_ended_task_raised_is_retrieved() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(fails())
    await asyncio.wait([task], timeout=5)
    assert await cancel_and_wait([task]) == set()
    assert isinstance(task.exception(), ValueError)
