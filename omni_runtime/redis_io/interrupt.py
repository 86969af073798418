"""Ending a blocking Redis read from outside: at shutdown, and so an idle reader barely wakes.

Two readers, two ways. An asyncio reader (the orchestrator's, `ReadInterrupt`) blocked in
XREADGROUP would otherwise hold shutdown for up to a whole `block_ms` (several readers one
after another, for several). Its read runs as a task of its own that the caller waits on
together with the interrupt: interrupted, the caller returns at once and the read is
cancelled. redis-py drops a connection whose command was cancelled, and may also let a
cancellation that arrives while it is still sending the command pass unnoticed: then the
read just finishes in the background, unread. Either way an entry the server delivered to
the cut read stays in the consumer's pending list, so the next reader with that consumer
name reads it again as backlog. Nothing is lost; it is only read later.

A reading thread (a worker's inputs and aborts, `OwnConnection`) blocks on a connection of
its own. Its blocking read may then last seconds, since the read returns the moment an
entry arrives, and stopping the thread ends it with `CLIENT UNBLOCK` (the read returns
empty, as on a timeout) instead of waiting it out. Where that cannot be had (a Redis
Cluster client, a client without real sockets, a user the ACL denies `CLIENT`) the thread
keeps the shared client and short reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
from redis.connection import AbstractConnection
from redis.exceptions import RedisError

from omni_runtime.redis_io import conn as rconn
from omni_runtime.redis_io.clients import is_cluster

log = logging.getLogger(__name__)

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


IDLE_BLOCK_MS = 4_000
"""Blocking-read timeout of a thread whose read can be ended from outside (a second short
of redis-py's default socket timeout, which would otherwise cut the read as a failure)."""
TIMEOUT_MARGIN_MS = 1_000


class OwnConnection:
    """The client a reading thread reads with, and how another thread ends its read."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        self.shared = client
        self.client = client
        """What the reading thread uses: its own connection when its read can be ended."""
        self._id: int | None = None
        if is_cluster(client):
            return
        own: redis.Redis | None = None
        try:
            own = redis.Redis(connection_pool=client.connection_pool, single_connection_client=True)
            conn = own.connection
            if conn is None or rconn.socket_of(conn) is None:
                own.close()
                return
            self._connected(conn)
            self.shared.client_unblock(self._id or 0)  # allowed? (nothing blocked: a no-op)
            rconn.on_connect(conn, self._connected)
        except RedisError as e:
            log.info("%s keeps short blocking reads (%s)", name, e)
            self._id = None
            if own is not None:
                own.close()
            return
        self.client = own
        timeout_s = rconn.pool_option(client, "socket_timeout")
        self._long_ms = IDLE_BLOCK_MS
        if timeout_s is not None:
            self._long_ms = min(IDLE_BLOCK_MS, int(timeout_s * 1000) - TIMEOUT_MARGIN_MS)

    def block_ms(self, short_ms: int) -> int:
        """How long the thread's blocking read may last."""
        return max(short_ms, self._long_ms) if self._id is not None else short_ms

    def unblock(self) -> None:
        """From any thread: end the read in progress, if any (it returns empty)."""
        if self._id is not None:
            with contextlib.suppress(RedisError):
                self.shared.client_unblock(self._id)

    def close(self) -> None:
        if self.client is not self.shared:
            self.client.close()

    def _connected(self, conn: AbstractConnection) -> None:
        """On every (re)connection: learn the connection's id, which changes with it."""
        rconn.send(conn, [("CLIENT", "ID")])
        self._id = int(rconn.reply(conn))
