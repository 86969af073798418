"""One round trip of commands packed by hand: the chunk put's hot path, without redis-py's
pipeline object (its per-call bookkeeping costs more than the round trip's own Python).

Only what the put sends (`SET … EX`, `RPUSH`, `EXPIRE`, `GET`), optionally in
`MULTI/EXEC`, on the connection a `HeldPuts` keeps for them (else one from the client's
pool for the call). Replies are raw (bytes, ints, None), as the put's callers read them.
A failed call drops its connection (a half-read reply must not go back to the pool) and
raises `RedisError`.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, cast

import redis
from redis.connection import Connection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError

from omni_runtime.redis_io import conn as rconn


class PutPipe(Protocol):
    """What a put queues its commands on."""

    def set(self, name: str, value: bytes, ex: int) -> Any: ...
    def rpush(self, name: str, *values: bytes) -> Any: ...
    def expire(self, name: str, seconds: int) -> Any: ...
    def get(self, name: str) -> Any: ...
    def execute(self) -> list[Any]: ...


def put_pipe(
    client: redis.Redis, transaction: bool, cluster: bool, held: HeldPuts | None = None
) -> PutPipe:
    """Packed by hand on a single server; redis-py's pipeline on a cluster (it routes)."""
    if cluster:
        return cast(PutPipe, client.pipeline(transaction=transaction))
    return PackedPipe(client, transaction, held)


class HeldPuts:
    """A connection kept for puts between them: a pool's get and release (redis-py 8
    probes the socket on every get) cost more than packing a one-chunk put
    (docs/performance.md). Whoever finds it free uses it (a try-lock); a put made at the same moment on
    another thread takes a pooled connection as before."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.lock = threading.Lock()
        self.conn: Connection | None = None

    def drop(self) -> None:
        """Under `lock`: the held connection failed; the next put takes a fresh one."""
        if self.conn is not None:
            rconn.drop(self.conn)
            rconn.give_back(self.pool, self.conn)
            self.conn = None

    def close(self) -> None:
        with self.lock:
            self.drop()


class PackedPipe:
    """Queue commands, then `execute()`: one send, one read of every reply."""

    def __init__(
        self, client: redis.Redis, transaction: bool, held: HeldPuts | None = None
    ) -> None:
        self.pool: ConnectionPool = client.connection_pool
        self.transaction = transaction
        self.held = held
        self.commands: list[tuple[Any, ...]] = []

    def set(self, name: str, value: bytes, ex: int) -> None:
        self.commands.append(("SET", name, value, "EX", ex))

    def rpush(self, name: str, *values: bytes) -> None:
        self.commands.append(("RPUSH", name, *values))

    def expire(self, name: str, seconds: int) -> None:
        self.commands.append(("EXPIRE", name, seconds))

    def get(self, name: str) -> None:
        self.commands.append(("GET", name))

    def execute(self) -> list[Any]:
        cmds = self.commands
        if self.transaction:
            cmds = [("MULTI",), *cmds, ("EXEC",)]
        held = self.held
        if held is not None and held.lock.acquire(blocking=False):
            try:
                fresh = held.conn is None
                if fresh:
                    held.conn = rconn.take(self.pool)
                try:
                    return self._unwrap(rconn.round_trip(cast(Connection, held.conn), cmds))
                except RedisConnectionError:
                    held.drop()
                    if fresh:
                        raise
                    # A held connection may have gone stale unseen (the pool would have
                    # probed it): once more on a fresh one. Puts are idempotent.
            finally:
                held.lock.release()
        conn = rconn.take(self.pool)
        try:
            return self._unwrap(rconn.round_trip(conn, cmds))
        finally:
            rconn.give_back(self.pool, conn)

    def _unwrap(self, replies: list[Any]) -> list[Any]:
        return list(replies[-1]) if self.transaction else replies
