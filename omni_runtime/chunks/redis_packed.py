"""One round trip of commands packed by hand: the chunk put's hot path, without redis-py's
pipeline object (its per-call bookkeeping costs more than the round trip's own Python).

Only what the put sends (`SET … EX`, `RPUSH`, `EXPIRE`, `GET`), optionally in
`MULTI/EXEC`, on a connection taken from the client's pool for the call. Replies are
raw (bytes, ints, None), as the put's callers read them. A failed call drops its
connection (a half-read reply must not go back to the pool) and raises `RedisError`.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import redis
from redis.connection import ConnectionPool


class PutPipe(Protocol):
    """What a put queues its commands on."""

    def set(self, name: str, value: bytes, ex: int) -> Any: ...
    def rpush(self, name: str, *values: bytes) -> Any: ...
    def expire(self, name: str, seconds: int) -> Any: ...
    def get(self, name: str) -> Any: ...
    def execute(self) -> list[Any]: ...


def put_pipe(client: redis.Redis, transaction: bool, cluster: bool) -> PutPipe:
    """Packed by hand on a single server; redis-py's pipeline on a cluster (it routes)."""
    if cluster:
        return cast(PutPipe, client.pipeline(transaction=transaction))
    return PackedPipe(client, transaction)


class PackedPipe:
    """Queue commands, then `execute()`: one send, one read of every reply."""

    def __init__(self, client: redis.Redis, transaction: bool) -> None:
        self.pool: ConnectionPool = client.connection_pool
        self.transaction = transaction
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
        conn = self.pool.get_connection()
        try:
            conn.send_packed_command(conn.pack_commands(cmds))  # type: ignore[no-untyped-call]
            replies = [conn.read_response() for _ in cmds]
        except BaseException:
            conn.disconnect()  # type: ignore[no-untyped-call]
            raise
        finally:
            self.pool.release(conn)
        return list(replies[-1]) if self.transaction else replies
