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

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.connection
import redis.asyncio.sentinel as aiosentinel
import redis.connection
import redis.sentinel
from redis.connection import parse_url

from omni_runtime.redis_io.conn import (
    AsyncFollowingConnection,
    AsyncFollowingSSLConnection,
    FollowingConnection,
    FollowingSSLConnection,
)

SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379
SENTINEL_ONLY = ("sentinel_username", "sentinel_password")
"""Query options for the sentinels themselves, not the Redis servers."""


def is_sentinel_url(url: str) -> bool:
    return urlsplit(url).scheme in SCHEMES


@dataclass(frozen=True)
class SentinelTarget:
    """What a `redis+sentinel://` URL says: where the sentinels are, which service."""

    sentinels: list[tuple[str, int]]
    service: str
    connection_kwargs: dict[str, Any] = field(default_factory=dict)
    """For the Redis servers (db, password, timeouts, ssl): redis-py's URL options."""
    sentinel_kwargs: dict[str, Any] = field(default_factory=dict)
    """Auth for the sentinels themselves (the socket options are added per client)."""

    def where(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"service {self.service!r} of sentinels {hosts}"


def parse_sentinel_url(url: str) -> SentinelTarget:
    """`ValueError` (one line) for a URL that names no sentinel or no service."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"not a sentinel URL (redis+sentinel://...): {url!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not port.isdigit():  # no port given ("host", "[::1]")
            host, port = item.strip(), str(DEFAULT_SENTINEL_PORT)
        host = host.strip("[]")
        if not host or not 0 < int(port) < 65536:
            raise ValueError(f"sentinel URL has a bad sentinel address {item!r}")
        sentinels.append((unquote(host), int(port)))
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("sentinel URL must name its service: redis+sentinel://host:port/service")
    query = parse_qs(parts.query)
    sentinel_kwargs = {
        name.removeprefix("sentinel_"): unquote(query.pop(name)[0])
        for name in SENTINEL_ONLY
        if name in query
    }
    # redis-py parses the rest, so the options mean what they mean in a redis:// URL.
    plain = "rediss" if parts.scheme.startswith("rediss") else "redis"
    auth = f"{userinfo}@" if userinfo else ""
    db = f"/{quote(path[1])}" if len(path) == 2 else ""
    rest = urlencode({k: v[0] for k, v in query.items()})
    kwargs: dict[str, Any] = parse_url(
        f"{plain}://{auth}sentinel-service{db}" + (f"?{rest}" if rest else "")
    )
    for name in ("host", "port", "connection_class"):
        kwargs.pop(name, None)
    if plain == "rediss":
        kwargs["ssl"] = True
    return SentinelTarget(sentinels, path[0], kwargs, sentinel_kwargs)


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


class SentinelRedis(redis.Redis):
    """A primary's client that also closes the sentinel clients it was made with."""

    sentinel_manager: redis.sentinel.Sentinel | None = None

    def close(self) -> None:
        super().close()
        if self.sentinel_manager is not None:
            self.sentinel_manager.close()
            self.sentinel_manager = None


class AsyncSentinelRedis(aioredis.Redis):
    """`SentinelRedis` for asyncio."""

    sentinel_manager: aiosentinel.Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel_manager is not None:
            manager, self.sentinel_manager = self.sentinel_manager, None
            await manager.aclose()


def sync_primary(url: str, **redis_kwargs: Any) -> redis.Redis:
    """A sync client of the service's primary, whatever server that is now."""
    target = parse_sentinel_url(url)
    kwargs = _kwargs(target, redis_kwargs, aio=False)
    sentinel_kwargs = {**_socket_options(kwargs), **target.sentinel_kwargs}
    manager = redis.sentinel.Sentinel(target.sentinels, sentinel_kwargs=sentinel_kwargs, **kwargs)
    client: SentinelRedis = manager.master_for(target.service, redis_class=SentinelRedis)
    client.sentinel_manager = manager
    return client


def async_primary(url: str, **redis_kwargs: Any) -> aioredis.Redis:
    """An asyncio client of the service's primary."""
    target = parse_sentinel_url(url)
    kwargs = _kwargs(target, redis_kwargs, aio=True)
    sentinel_kwargs = {**_socket_options(kwargs), **target.sentinel_kwargs}
    manager = aiosentinel.Sentinel(target.sentinels, sentinel_kwargs=sentinel_kwargs, **kwargs)
    client: AsyncSentinelRedis = manager.master_for(target.service, redis_class=AsyncSentinelRedis)
    client.sentinel_manager = manager
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
