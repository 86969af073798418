"""Long blocking reads that a stop still ends at once: an idle worker barely wakes.

A reading thread (inputs, aborts) blocks on a connection of its own. Its blocking
read may then last seconds, since the read returns the moment an entry arrives,
and stopping the thread ends it with `CLIENT UNBLOCK` (the read returns empty, as
on a timeout) instead of waiting it out. Where that cannot be had — a Redis
Cluster client, a client without real sockets, a user the ACL denies `CLIENT` —
the thread keeps the shared client and short reads.
"""

from __future__ import annotations

import contextlib
import logging

import redis
from redis.connection import AbstractConnection
from redis.exceptions import RedisError

from omni_runtime.redis_io import conn as rconn
from omni_runtime.redis_io.clients import is_cluster

log = logging.getLogger(__name__)

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
        rconn.send_one(conn, "CLIENT", "ID")
        self._id = int(rconn.reply(conn))
