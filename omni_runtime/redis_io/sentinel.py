"""Redis Sentinel: `redis+sentinel://` URLs and the clients that follow the primary.

A URL names the sentinels and the service, not a server:

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?options]

(`rediss+sentinel://` for TLS to the servers; the port defaults to 26379). The user and
password are the Redis servers' (the sentinels are asked without them unless the query
says `sentinel_username=` / `sentinel_password=`); the other query options are redis-py's
URL options. Every client is built on redis-py's Sentinel support: its connection pool
asks the sentinels for the primary on every connect and drops connections to a demoted
one (READONLY is a connection error), so the runtime's own retry loops, and the modules
that hand-pack commands on a pool's raw connection, reconnect to the new primary.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.connection
import redis.asyncio.sentinel as aiosentinel
import redis.connection
import redis.sentinel

from omni_runtime.redis_io.conn import (
    AsyncFollowingConnection,
    AsyncFollowingSSLConnection,
    FollowingConnection,
    FollowingSSLConnection,
)
from omni_runtime.sentinel_url import SentinelTarget, parse_sentinel_url


def _socket_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k.startswith("socket_")}


def _kwargs(target: SentinelTarget, redis_kwargs: dict[str, Any], aio: bool) -> dict[str, Any]:
    kwargs = {**target.connection_kwargs, **redis_kwargs}
    ssl = kwargs.pop("ssl", False)
    if aio:
        kwargs["connection_class"] = (
            AsyncFollowingSSLConnection if ssl else AsyncFollowingConnection
        )
    else:
        kwargs["connection_class"] = FollowingSSLConnection if ssl else FollowingConnection
    return kwargs


# redis-py's `discover_master` moves the sentinel that answered to the front of the
# manager's list by index, after awaiting its answer. Two lookups at once (every task or
# thread whose connection reconnects during a failover) can then write one client into
# two places and drop another from the list, and `Sentinel.close` closes only what the
# list holds. So each primary's client keeps the sentinel clients it was made with.


class SentinelRedis(redis.Redis):
    """A primary's client that also closes the sentinel clients it was made with."""

    sentinel_clients: tuple[redis.Redis, ...] = ()

    def close(self) -> None:
        try:
            super().close()
        finally:
            clients, self.sentinel_clients = self.sentinel_clients, ()
            for sentinel in clients:
                sentinel.close()


class AsyncSentinelRedis(aioredis.Redis):
    """`SentinelRedis` for asyncio."""

    sentinel_clients: tuple[aioredis.Redis, ...] = ()

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            clients, self.sentinel_clients = self.sentinel_clients, ()
            for sentinel in clients:
                await sentinel.aclose()


def sync_primary(url: str, **redis_kwargs: Any) -> redis.Redis:
    """A sync client of the service's primary, whatever server that is now."""
    target = parse_sentinel_url(url)
    kwargs = _kwargs(target, redis_kwargs, aio=False)
    sentinel_kwargs = {**_socket_options(kwargs), **target.sentinel_kwargs}
    manager = redis.sentinel.Sentinel(target.sentinels, sentinel_kwargs=sentinel_kwargs, **kwargs)
    client: SentinelRedis = manager.master_for(target.service, redis_class=SentinelRedis)
    client.sentinel_clients = tuple(manager.sentinels)
    return client


def async_primary(url: str, **redis_kwargs: Any) -> aioredis.Redis:
    """An asyncio client of the service's primary."""
    target = parse_sentinel_url(url)
    kwargs = _kwargs(target, redis_kwargs, aio=True)
    sentinel_kwargs = {**_socket_options(kwargs), **target.sentinel_kwargs}
    manager = aiosentinel.Sentinel(target.sentinels, sentinel_kwargs=sentinel_kwargs, **kwargs)
    client: AsyncSentinelRedis = manager.master_for(target.service, redis_class=AsyncSentinelRedis)
    client.sentinel_clients = tuple(manager.sentinels)
    return client


def primary_address(url: str, timeout_s: float) -> tuple[str, int]:
    """The primary's address as the sentinels say now; `redis.sentinel.MasterNotFoundError`
    (a ConnectionError) when none answers or none knows a healthy primary."""
    target = parse_sentinel_url(url)
    options = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    manager = redis.sentinel.Sentinel(
        target.sentinels, sentinel_kwargs={**options, **target.sentinel_kwargs}
    )
    try:
        host, port = manager.discover_master(target.service)
        return str(host), int(port)
    finally:
        manager.close()
