"""The stream writer's round trip packed by hand, without redis-py's asyncio pipeline.

A writer batch is tens to hundreds of commands whose replies it only checks for errors,
and redis-py's pipeline spends more Python per command (its command stack, a retry
wrapper, a response callback looked up per reply) than packing and parsing do. Only
the commands `write_ops.fill_pipeline` queues, on a connection taken from the client's
pool for the call. A failed call drops its connection (a half-read reply must not go
back to the pool) and raises. Cluster clients keep redis-py's pipeline (it routes).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis


class AsyncPackedPipe:
    """Queue `fill_pipeline`'s commands, then `execute()`: one send, every reply read."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.commands: list[tuple[Any, ...]] = []

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

    def hset(self, name: str, mapping: dict[str, bytes]) -> None:
        self.commands.append(("HSET", name, *(part for pair in mapping.items() for part in pair)))

    def hdel(self, name: str, *keys: str) -> None:
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

    async def execute(self) -> list[Any]:
        """Every reply, raw; an error reply raises (`ResponseError`), as redis-py's would."""
        cmds, self.commands = self.commands, []
        if not cmds:
            return []
        pool = self.client.connection_pool
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            await conn.send_packed_command(conn.pack_commands(cmds))
            return [await conn.read_response() for _ in cmds]
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)
