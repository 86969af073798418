"""Reading a consumer's pending backlog only: what a slot taken over must finish.

A `GroupReader` walks its backlog and then goes on to new entries; an orchestrator
serving a slot it took over must not take new requests for it (its own slot does),
so it reads that slot's backlog alone, through the reader's cursor and checks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar

from redis.exceptions import RedisError

from omni_runtime.redis_io.streams import GroupReader, stream_reply

log = logging.getLogger(__name__)

M = TypeVar("M")
RETRY_S = 0.5


async def read_backlog(reader: GroupReader[M], count: int) -> list[tuple[bytes, M]] | None:
    """The reader's consumer's next pending entries (never new ones); None once walked."""
    if not reader.cursor.in_backlog:
        return None
    try:  # a read of pending entries never blocks
        reply = await reader.client.xreadgroup(
            reader.group, reader.consumer, {reader.stream: reader.cursor.next_id}, count
        )
    except RedisError as e:
        log.warning("reading the backlog of %s failed: %r", reader.stream, e)
        await asyncio.sleep(RETRY_S)
        return []
    entries = [entry for _s, batch in stream_reply(reply) for entry in batch]
    reader.cursor.advance(entries)
    return await reader.accept(entries) if entries else []
