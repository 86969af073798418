"""Consumer groups: created from the stream's start, recognised when they vanish."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError


def ensure_group_sync(client: redis.Redis, stream: str, group: str) -> None:
    """Create the group from id 0 so entries written before it existed are still read."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """`ensure_group_sync` for the event loop."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def no_group(e: ResponseError) -> bool:
    """The group or its stream vanished (Redis flushed: UNBLOCKED while blocked in the
    read; fakeredis words a vanished stream its own way)."""
    text = str(e)
    return any(m in text for m in ("NOGROUP", "UNBLOCKED", "requires the key to exist"))
