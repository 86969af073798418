"""How every process gets its Redis clients: from the URL, or from a factory in tests.

Passing factories (not URLs) down lets the integration tests run the very
same orchestrator, worker and client over one in-process fakeredis server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.connection import PythonRespSerializer

_PACKER_BUFFER_CUTOFF = 6000  # redis-py's own cut-off between joining and listing parts


def sync_client_from_url(url: str, **kwargs: Any) -> redis.Redis:
    """A sync client whose commands are packed by redis-py's Python packer.

    hiredis's packer copies each argument into a fresh mmap'd buffer and is ~5x
    slower for MiB-size values (research: redis_substrate §0.2); audio and
    tensor chunks are exactly those.
    """
    pool = redis.ConnectionPool.from_url(url, **kwargs)
    pool.connection_kwargs["command_packer"] = PythonRespSerializer(
        _PACKER_BUFFER_CUTOFF, pool.get_encoder().encode
    )
    return redis.Redis.from_pool(pool)


@dataclass(frozen=True)
class RedisClients:
    sync: Callable[[], redis.Redis]
    aio: Callable[[], aioredis.Redis]

    @classmethod
    def from_url(cls, url: str) -> RedisClients:
        return cls(
            sync=lambda: sync_client_from_url(url),
            aio=lambda: aioredis.Redis.from_url(url),
        )
