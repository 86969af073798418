"""Waiting on a condition with a deadline: the only way tests here synchronise."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(cond: Callable[[], bool], deadline_s: float = 10.0) -> None:
    """Poll `cond` (threads do the work) until it holds; fail at the deadline."""
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, "condition not met before the deadline"
        time.sleep(0.001)


async def wait_for(cond: Callable[[], bool], deadline_s: float = 10.0) -> None:
    """`wait_until` for the event loop: other tasks run between the checks."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not cond():
        assert loop.time() < end, "condition not met before the deadline"
        await asyncio.sleep(0.001)
