"""Waiting on a condition with a deadline: the only way tests here synchronise."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


def wait_until(
    cond: Callable[[], bool], deadline_s: float = 10.0, explain: Callable[[], str] | None = None
) -> None:
    """Poll `cond` (threads do the work) until it holds; fail at the deadline, saying what
    `explain` says of the state it stopped in."""
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() >= end:
            detail = f": {explain()}" if explain is not None else ""
            raise AssertionError(f"condition not met before the deadline{detail}")
        time.sleep(0.001)


async def wait_for(
    cond: Callable[[], bool], deadline_s: float = 10.0, explain: Callable[[], str] | None = None
) -> None:
    """`wait_until` for the event loop: other tasks run between the checks."""

    async def holds() -> bool:
        return cond()

    await wait_for_async(holds, deadline_s, explain)


async def wait_for_async(
    cond: Callable[[], Awaitable[bool]],
    deadline_s: float = 10.0,
    explain: Callable[[], str] | None = None,
    every_s: float = 0.001,
) -> None:
    """`wait_for` of a condition that is itself awaited (a request to a server, asked
    again `every_s`)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not await cond():
        if loop.time() >= end:
            detail = f": {explain()}" if explain is not None else ""
            raise AssertionError(f"condition not met before the deadline{detail}")
        await asyncio.sleep(every_s)
