"""Cutting a blocking Redis read short, so a process stops at once instead of after `block_ms`.

A reader blocked in XREADGROUP would otherwise hold shutdown for up to a whole
`block_ms` (several readers one after another, for several). The read runs as a
task of its own that the caller waits on together with the interrupt: interrupted,
the caller returns at once and the read is cancelled. redis-py drops a connection
whose command was cancelled, and may also let a cancellation that arrives while it
is still sending the command pass unnoticed: then the read just finishes in the
background, unread. Either way an entry the server delivered to the cut read stays
in the consumer's pending list, so the next reader with that consumer name reads it
again as backlog. Nothing is lost; it is only read later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class ReadInterrupted(Exception):
    """The read was cut short by `ReadInterrupt.interrupt` (or began after it)."""


def _retrieve(task: asyncio.Task[Any]) -> None:
    """An abandoned read's outcome is nobody's: fetched, so asyncio does not report it."""
    if not task.cancelled():
        task.exception()


class ReadInterrupt:
    """Runs one blocking read at a time; `interrupt()` ends it and every later one.

    Once interrupted, a read hands out nothing, even one that had just completed:
    whatever it was delivered stays pending (see the module's docstring).
    """

    def __init__(self) -> None:
        self.interrupted = False
        self._current: tuple[asyncio.Task[Any], asyncio.Future[None]] | None = None

    @property
    def running(self) -> bool:
        """A read is in progress (a blocking one: waiting for entries)."""
        return self._current is not None

    def interrupt(self) -> None:
        """Safe to call any time, from the event loop's thread; idempotent."""
        self.interrupted = True
        if self._current is not None:
            read, woken = self._current
            read.cancel()
            _wake(woken)

    async def run(self, read: Callable[[], Awaitable[T]]) -> T:
        """`await read()`, or ReadInterrupted if interrupted before or while it runs."""
        if self.interrupted:
            raise ReadInterrupted
        loop = asyncio.get_running_loop()
        task: asyncio.Task[T] = loop.create_task(_awaited(read))
        woken: asyncio.Future[None] = loop.create_future()
        task.add_done_callback(_retrieve)
        task.add_done_callback(lambda _t: _wake(woken))
        self._current = (task, woken)
        try:
            await woken
        except asyncio.CancelledError:
            task.cancel()  # the caller is cancelled: its read goes with it
            raise
        finally:
            self._current = None
        if self.interrupted:
            task.cancel()
            raise ReadInterrupted
        return task.result()


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


async def _awaited(read: Callable[[], Awaitable[T]]) -> T:
    return await read()
