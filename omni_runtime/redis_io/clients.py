"""How every process gets its Redis clients: from the URL, or from a factory in tests.

Passing factories (not URLs) down lets the integration tests run the very
same orchestrator, worker and client over one in-process fakeredis server.
`sync_client` is the one place the command packer is chosen (the chunk
connector builds its client here too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.connection import PythonRespSerializer

PACKER_BUFFER_CUTOFF = 6000
"""redis-py's own cut-off between joining small arguments and sending large ones as is."""


def sync_client(url: str, **redis_kwargs: Any) -> redis.Redis:
    """A sync client for `url` whose commands are packed by redis-py's Python packer.

    hiredis's packer copies each argument into a fresh mmap'd buffer and is ~5x
    slower for MiB-size values; audio and tensor chunks are exactly those.
    `redis_kwargs` go to the pool (e.g. `retry=`); closing the client closes it.
    """
    pool = redis.ConnectionPool.from_url(url, **redis_kwargs)
    # Built from the pool's own encoder so str arguments are encoded as the URL says
    # (`encoding=`); the pool hands this one stateless packer to every connection.
    pool.connection_kwargs["command_packer"] = PythonRespSerializer(
        PACKER_BUFFER_CUTOFF, pool.get_encoder().encode
    )
    return redis.Redis.from_pool(pool)


@dataclass(frozen=True)
class RedisClients:
    """Factories of the sync and async clients of one Redis."""

    sync: Callable[[], redis.Redis]
    aio: Callable[[], aioredis.Redis]

    @classmethod
    def from_url(cls, url: str) -> RedisClients:
        return cls(sync=lambda: sync_client(url), aio=lambda: aioredis.Redis.from_url(url))
