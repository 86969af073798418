"""What a `redis+sentinel://` URL names: the sentinels and the service (`redis_io/sentinel.py`
builds the clients). Apart from them so that `Settings` can check a URL without importing
the Redis kit:

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?options]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

from redis.connection import parse_url

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
