"""The stream writer's round trip packed by hand, without redis-py's asyncio pipeline.

A writer batch is tens to hundreds of commands whose replies it only checks for errors,
and redis-py's pipeline spends more Python per command (its command stack, a retry
wrapper, a response callback looked up per reply) than packing and parsing do. Only
the commands `write_ops.fill_pipeline` queues, on a connection taken from the client's
pool for the call or one the caller holds; `send` alone writes them at once, from a
plain function, and `replies` reads them later. Every reply is read, error replies
included (Redis ran the commands around a refused one): the caller gets each command's
result or error (`raise_on_error=False`), or the first error. A call that fails otherwise
drops its connection (a half-read reply must not be read again) and raises. Cluster
clients keep redis-py's pipelines (they route), one per group of `write_ops.phases`.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from omni_runtime.redis_io import conn as rconn
from omni_runtime.redis_io.write_ops import Op, fill_pipeline, phases


class AsyncPackedPipe:
    """Queue `fill_pipeline`'s commands, then `execute()`: one send, every reply read."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.commands: list[tuple[Any, ...]] = []
        self._sent: list[tuple[Any, ...]] = []

    async def __aenter__(self) -> AsyncPackedPipe:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.commands = []

    def xadd(
        self,
        name: str,
        fields: dict[Any, Any],
        maxlen: int | None = None,
        approximate: bool = True,
        minid: int | None = None,
    ) -> None:
        trim: tuple[Any, ...] = ()
        if maxlen is not None:
            trim = ("MAXLEN", "~", maxlen) if approximate else ("MAXLEN", maxlen)
        elif minid is not None:
            trim = ("MINID", "~", minid) if approximate else ("MINID", minid)
        pairs = [part for pair in fields.items() for part in pair]
        self.commands.append(("XADD", name, *trim, "*", *pairs))

    def hset(self, name: str, mapping: dict[str | bytes, bytes]) -> None:
        self.commands.append(("HSET", name, *(part for pair in mapping.items() for part in pair)))

    def hdel(self, name: str, *keys: str | bytes) -> None:
        self.commands.append(("HDEL", name, *keys))

    def persist(self, name: str) -> None:
        self.commands.append(("PERSIST", name))

    def pexpireat(self, name: str, when: int) -> None:
        self.commands.append(("PEXPIREAT", name, when))

    def xack(self, name: str, groupname: str, *ids: bytes) -> None:
        self.commands.append(("XACK", name, groupname, *ids))

    def xdel(self, name: str, *ids: bytes) -> None:
        self.commands.append(("XDEL", name, *ids))

    def expire(self, name: str, time: int) -> None:
        self.commands.append(("EXPIRE", name, time))

    async def execute(self, conn: Any = None, raise_on_error: bool = True) -> list[Any]:
        """Every reply, raw; an error reply raises (`ResponseError`), as redis-py's would,
        or with `raise_on_error=False` takes its command's place in the list.
        `conn`: a connection the caller holds (else one is taken from the pool for the call)."""
        if not self.commands:
            return []
        if conn is not None:
            await conn.connect()
            self.send(conn)
            return await self.replies(conn, raise_on_error)
        pool = self.client.connection_pool
        conn = await rconn.take_async(pool)
        try:
            self.send(conn)
            return await self.replies(conn, raise_on_error)
        finally:
            await pool.release(conn)

    def send(self, conn: Any) -> None:
        """Write the queued commands to `conn` (connected) now, without waiting: the socket
        takes them at once, or the transport buffers them (drained by `replies`)."""
        self._sent, self.commands = self.commands, []
        rconn.write_now(conn, self._sent)

    async def replies(self, conn: Any, raise_on_error: bool = True) -> list[Any]:
        """The replies of what `send` wrote, an error reply as its `ResponseError` (raised
        after every reply was read, the first one, unless `raise_on_error` is False). On
        any other failure the connection is dropped (a half-read reply must not be read as
        the next command's) and the error raised."""
        out: list[Any] = []
        async with rconn.in_step_async(conn):
            await rconn.drain(conn)
            for _ in self._sent:
                try:
                    out.append(await rconn.reply_async(conn))
                except ResponseError as e:  # read whole: the connection is still in step
                    out.append(e)
        if raise_on_error:
            for reply in out:
                if isinstance(reply, ResponseError):
                    raise reply
        return out


async def cluster_round_trips(client: Any, ops: list[Op]) -> tuple[list[Any], list[list[Op]]]:
    """A writer batch on a cluster: one redis-py pipeline per group of `write_ops.phases`,
    each sent once Redis answered the one before. Each command's reply or error, and the
    ops it carried."""
    replies: list[Any] = []
    carried: list[list[Op]] = []
    for phase in phases(ops):
        async with client.pipeline(transaction=False) as pipe:
            carried += fill_pipeline(pipe, phase)
            replies += await pipe.execute(raise_on_error=False)
    return replies, carried
