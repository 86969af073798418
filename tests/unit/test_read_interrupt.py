"""ReadInterrupt: a blocking read is cut short at once, whatever the read does with its
cancellation, and nothing is handed out after an interrupt."""

from __future__ import annotations

import asyncio

import pytest

from omni_runtime.redis_io.interrupt import ReadInterrupt, ReadInterrupted

GUARD_S = 30.0
"""Only a hang hits this: every wait below ends on an event."""


async def test_a_read_passes_its_result_and_its_errors_through() -> None:
    gate = ReadInterrupt()

    async def ok() -> str:
        return "entries"

    async def broken() -> str:
        raise ConnectionError("down")

    assert await gate.run(ok) == "entries"
    with pytest.raises(ConnectionError):
        await gate.run(broken)
    assert not gate.running


async def test_an_interrupt_ends_a_read_that_swallows_its_cancellation() -> None:
    """What redis-py does with a cancellation that arrives while it sends the command."""
    gate = ReadInterrupt()
    started, release, finished = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def stubborn() -> str:
        started.set()
        while True:
            try:
                await release.wait()
                break
            except asyncio.CancelledError:
                continue  # swallowed
        finished.set()
        return "late entries"

    reading = asyncio.create_task(gate.run(stubborn))
    await asyncio.wait_for(started.wait(), GUARD_S)
    assert gate.running
    gate.interrupt()
    with pytest.raises(ReadInterrupted):
        await asyncio.wait_for(reading, GUARD_S)  # the read itself is still blocked
    assert not finished.is_set() and not gate.running
    release.set()  # it ends in the background; its result is nobody's
    await asyncio.wait_for(finished.wait(), GUARD_S)


async def test_after_an_interrupt_no_read_starts_and_none_hands_anything_out() -> None:
    gate = ReadInterrupt()
    calls = 0

    async def read() -> str:
        nonlocal calls
        calls += 1
        return "entries"

    gate.interrupt()
    with pytest.raises(ReadInterrupted):
        await gate.run(read)
    assert calls == 0


async def test_cancelling_the_caller_cancels_its_read() -> None:
    gate = ReadInterrupt()
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def read() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    caller = asyncio.create_task(gate.run(read))
    await asyncio.wait_for(started.wait(), GUARD_S)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(cancelled.wait(), GUARD_S)
    assert not gate.interrupted
