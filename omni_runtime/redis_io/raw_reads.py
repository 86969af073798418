"""Stream reads packed and parsed by hand, where a reader owns its connection.

redis-py's command path (pool, retry wrapper, reply callbacks building dicts) costs
more than packing and parsing the read here (docs/performance.md). That is latency
on every hop (a worker's input thread parses before it hands over, and builds its next
read before it blocks again) and CPU per batch. Only where a reader holds a connection
no other thread uses: a single-connection client (a worker's input thread), or one an
`AsyncHeldReads` keeps (the orchestrator's joint read, a client's output reader).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis

from omni_runtime.redis_io import conn as rconn
from omni_runtime.redis_io.clients import is_cluster
from omni_runtime.redis_io.entries import Entry, stream_reply


def stream_entries(reply: Any) -> list[tuple[bytes, list[Entry]]]:
    """A raw XREAD / XREADGROUP reply as [(stream, [(id, fields), ...])]: a RESP3 map or
    a RESP2 array of pairs, None when nothing came; fields as a dict (empty for a pending
    entry trimmed since)."""
    if reply is None:
        return []
    pairs = reply.items() if isinstance(reply, dict) else reply
    return [
        (name, [(eid, dict(zip(f[::2], f[1::2], strict=True)) if f else {}) for eid, f in batch])
        for name, batch in pairs
    ]


def xreadgroup_sync(
    client: redis.Redis,
    group: str,
    consumer: str,
    streams: Mapping[str, bytes | str],
    count: int,
    block_ms: int,
) -> list[tuple[bytes, list[Entry]]]:
    """XREADGROUP GROUP `group` `consumer` COUNT BLOCK STREAMS …: by hand on the connection
    of a single-connection client, through redis-py on any other. Raises RedisError."""
    conn = getattr(client, "connection", None)
    if conn is None or is_cluster(client):
        reply = client.xreadgroup(group, consumer, dict(streams), count, block_ms)  # type: ignore[arg-type]
        return stream_reply(reply)
    args = ("XREADGROUP", "GROUP", group, consumer, "COUNT", count, "BLOCK", block_ms)
    with rconn.in_step(conn, keep_on_error_reply=True):  # a whole error reply: still in step
        rconn.send(conn, [(*args, "STREAMS", *streams, *streams.values())], check=False)
        reply = rconn.reply(conn)
    return stream_entries(reply)


class AsyncHeldReads:
    """Stream reads on one asyncio connection held for them (never released: the pool
    still closes it with the client), packed and parsed here. For one reader task: the
    pool's get and release alone cost more than the packing, redis-py's reply callbacks
    more again (docs/performance.md)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._conn: Any = None

    async def xread(
        self,
        streams: Mapping[str, bytes],
        count: int,
        block_ms: int,
        delete: Sequence[bytes] = (),
    ) -> list[tuple[bytes, list[Entry]]]:
        """XREAD COUNT BLOCK STREAMS …, after XDEL of `delete` from the first stream (what
        the last read returned) in the same send; through redis-py on a cluster (it routes
        by key: both in one pipeline, to the stream's node)."""
        stream = next(iter(streams))
        ids: dict[Any, Any] = dict(streams)  # (redis-py's typing wants its own key types)
        if is_cluster(self.client) and not delete:
            return stream_reply(await self.client.xread(ids, count=count, block=block_ms))
        if is_cluster(self.client):
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.xdel(stream, *delete)
                pipe.xread(ids, count=count, block=block_ms)
                _deleted, reply = await pipe.execute()
            return stream_reply(reply)
        gone = [("XDEL", stream, *delete)] if delete else []
        return await self.read(("XREAD", "COUNT", count, "BLOCK", block_ms), streams, gone)

    async def read(
        self,
        args: tuple[Any, ...],
        streams: Mapping[Any, Any],
        before: Sequence[rconn.Command] = (),
    ) -> list[tuple[bytes, list[Entry]]]:
        """`args` (XREAD or XREADGROUP, up to BLOCK), then STREAMS `streams`' names and ids;
        `before`: commands sent in the same write, ahead of the read (e.g. deleting what
        the last read returned: one send, not two), their replies read and dropped.
        Raises RedisError; a failed read drops the connection (a reply half read must not
        be read as the next one), and the next read connects anew."""
        if self._conn is None:
            self._conn = await rconn.take_async(self.client.connection_pool)
        conn = self._conn
        async with rconn.in_step_async(conn):
            read = (*args, "STREAMS", *streams, *streams.values())
            await rconn.send_async(conn, [*before, read], check_health=False)
            for _ in before:
                await rconn.reply_async(conn)  # an error reply raises: the read is unread
            reply = await rconn.reply_async(conn)
        return stream_entries(reply)
