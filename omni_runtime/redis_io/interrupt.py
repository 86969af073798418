"""Cutting a blocking Redis read short, so a process stops at once instead of after `block_ms`.

A reader blocked in XREADGROUP would otherwise hold shutdown for up to a whole
`block_ms` (several readers one after another, for several). Cancelling the read
is safe: redis-py drops a connection whose command was cancelled (never reused with
a reply in flight), and an entry the server delivered to the cut read stays in the
consumer's pending list, so the next reader with that consumer name reads it again
as backlog. Nothing is lost; it is only read later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class ReadInterrupted(Exception):
    """The read was cut short by `ReadInterrupt.interrupt` (or began after it)."""


class ReadInterrupt:
    """Runs one blocking read at a time; `interrupt()` cancels it and every later one.

    The read runs in the caller's own task (no task per read on the hot path): an
    interrupt cancels that task at its await and `run` turns exactly that cancellation
    into `ReadInterrupted`; a cancellation from anyone else still propagates.
    """

    def __init__(self) -> None:
        self.interrupted = False
        self._task: asyncio.Task[Any] | None = None

    @property
    def running(self) -> bool:
        """A read is in progress (a blocking one: waiting for entries)."""
        return self._task is not None

    def interrupt(self) -> None:
        """Safe to call any time, from the event loop's thread; idempotent."""
        if self.interrupted:
            return
        self.interrupted = True
        if self._task is not None:
            self._task.cancel()

    async def run(self, read: Callable[[], Awaitable[T]]) -> T:
        """`await read()`, or ReadInterrupted if interrupted before or while it runs."""
        if self.interrupted:
            raise ReadInterrupted
        task = self._task = asyncio.current_task()
        try:
            return await read()
        except asyncio.CancelledError:
            if not self.interrupted or task is None or task.uncancel() > 0:
                raise  # (also) cancelled by someone else: theirs to handle
            raise ReadInterrupted from None
        finally:
            self._task = None
