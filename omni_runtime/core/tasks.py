"""Stopping asyncio tasks for good.

redis-py's asyncio client can swallow a cancellation that lands while a command is in
progress (a task looping on SET, or on a blocking XREAD, against a real server can go on
running after `cancel()`: docs/performance.md). A task cancelled once and then awaited could keep a shutdown waiting for
ever. So a task is cancelled again, and again, until it has ended, within a deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

RECANCEL_S = 0.05
"""How long a cancelled task gets to end before it is cancelled again."""


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future[Any]], timeout_s: float = 5.0
) -> set[asyncio.Future[Any]]:
    """Cancel `tasks` until each has ended or `timeout_s` passed; the ones still running
    (logged). What the ended ones raised is retrieved, as `gather(...,
    return_exceptions=True)` would."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    every = list(tasks)
    pending = {t for t in every if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        left = end - loop.time()
        if left <= 0:
            break
        _done, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
    for task in every:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: never "exception was never retrieved"
    if pending:
        log.warning(
            "%d task(s) still running %.1f s after being cancelled", len(pending), timeout_s
        )
    return pending
