"""How every process gets its Redis clients: from the URL, or from a factory in tests.

Passing factories (not URLs) down lets the integration tests run the very
same orchestrator, worker and client over one in-process fakeredis server.
This module is the one place a client is constructed: `sync_client` chooses the
command packer, and a URL naming any node of a Redis Cluster gets redis-py's
cluster clients (`OMNI_REDIS_CLUSTER=auto` asks the server; `yes`/`no` force it).
A cluster client is typed as the plain client: both speak the same commands,
and the few places that differ (transactions, one dedicated connection) ask
`is_cluster`. A `redis+sentinel://` URL gets clients of the primary its sentinels name
(`sentinel.py`): plain clients whose pool finds the primary again on every reconnect.

At start-up `RedisClients.connect` also turns the three ways a deployment
can be unusable into one `FatalError` line each: Redis cannot be reached, the
cluster does not serve every slot, the ACL user may not touch the namespace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.backoff import NoBackoff
from redis.connection import ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from omni_runtime.errors import NO_REDIS_URL, ConfigError, FatalError
from omni_runtime.redis_io.conn import (
    StreamRoutedCluster,
    read_stream,
    use_small_first,
    use_small_first_async,
)
from omni_runtime.redis_io.sentinel import async_primary, primary_address, sync_primary
from omni_runtime.sentinel_url import is_sentinel_url, parse_sentinel_url

CLUSTER_SLOTS = 16384
REDIS_FAILURES: tuple[type[Exception], ...] = (RedisError, RedisClusterException, OSError)
"""What a Redis round trip raises when Redis, the network or a cluster's routing fails:
redis-py's errors, the one of its cluster client that is no `RedisError`, and a socket's
own (redis-py wraps most in its `ConnectionError`, a hand-packed write may not)."""
PROBE_TIMEOUT_S = 5.0
"""The start-up probe's connect and read timeout: a dead address fails in seconds."""

ClusterMode = Literal["auto", "yes", "no"]


def redacted(url: str) -> str:
    """`url` without its password, for messages."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")  # hosts: a sentinel URL's may be many
    if ":" not in userinfo:
        return url
    netloc = f"{userinfo.split(':', 1)[0]}:***{at}{hosts}"
    return urlunsplit(parts._replace(netloc=netloc))


def is_cluster(client: object) -> bool:
    """Whether `client` is one of redis-py's cluster clients (sync or asyncio). Decided
    once per class: redis-py's clients are protocol classes, whose `isinstance` runs
    Python code every time, and some paths ask once per read."""
    kind = type(client)
    known = _CLUSTER_CLASSES.get(kind)
    if known is None:
        known = _CLUSTER_CLASSES[kind] = issubclass(kind, _CLUSTER_BASES)
    return known


_CLUSTER_BASES = (redis.cluster.RedisCluster, aiocluster.RedisCluster)
_CLUSTER_CLASSES: dict[type, bool] = {}


def cluster_info(client: redis.Redis) -> dict[str, str]:
    """CLUSTER INFO as a dict of strings (redis-py parses the reply; keep both shapes)."""
    info = client.execute_command("CLUSTER INFO")
    if isinstance(info, dict):
        return {str(k): v.decode() if isinstance(v, bytes) else str(v) for k, v in info.items()}
    text = info.decode() if isinstance(info, bytes) else str(info)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def probe(url: str, mode: ClusterMode = "auto") -> bool:
    """Connect once to `url`; True if it is a node of a Redis Cluster that serves every slot.

    `FatalError` (one line, no retry) when nothing answers, or when the cluster has
    slots nobody serves (every command on them would fail). A sentinel URL: whether the
    sentinels name a primary that answers (never a cluster).
    """
    if is_sentinel_url(url):
        return _probe_sentinel(url, mode)
    client = redis.Redis.from_url(
        url,
        socket_connect_timeout=PROBE_TIMEOUT_S,
        socket_timeout=PROBE_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
    )
    where = redacted(url)
    try:
        client.ping()
        if mode == "auto":
            try:
                info = client.info("cluster")
                clustered = bool(int(info.get("cluster_enabled", 0)))
            except ResponseError:  # INFO denied to an ACL user, or a server without the section
                clustered = bool(_cluster_fields(client))
        else:
            clustered = mode == "yes"
        if clustered:
            fields = _cluster_fields(client)
            if fields is None:
                raise FatalError(f"Redis at {where} is no cluster node (OMNI_REDIS_CLUSTER=yes)")
            state, ok = fields.get("cluster_state", "ok"), fields.get("cluster_slots_ok", "0")
            if state != "ok":
                raise FatalError(
                    f"Redis Cluster at {where} is not serving: cluster_state:{state}, "
                    f"{fields.get('cluster_slots_assigned', '?')} of {CLUSTER_SLOTS} slots "
                    f"assigned, {ok} served (assign every slot, or wait for failover)"
                )
        return clustered
    except (RedisConnectionError, RedisTimeoutError) as e:
        raise FatalError(f"Redis at {where} cannot be reached: {e}") from e
    except RedisError as e:
        raise FatalError(f"Redis at {where} answered the start-up check with: {e}") from e
    finally:
        client.close()


def _probe_sentinel(url: str, mode: ClusterMode) -> bool:
    try:
        target = parse_sentinel_url(url)
    except ValueError as e:
        raise FatalError(str(e)) from e
    if mode == "yes":
        raise FatalError(f"{target.where()} is no Redis Cluster (OMNI_REDIS_CLUSTER=yes)")
    try:
        host, port = primary_address(url, PROBE_TIMEOUT_S)
    except RedisError as e:  # MasterNotFoundError: no sentinel answers, or none knows one
        raise FatalError(f"Redis Sentinel: no primary for {target.where()}: {e}") from e
    client = sync_client(
        url,
        socket_connect_timeout=PROBE_TIMEOUT_S,
        socket_timeout=PROBE_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        client.ping()
    except RedisError as e:
        raise FatalError(
            f"Redis Sentinel: the primary {host}:{port} of {target.where()} cannot be used: {e}"
        ) from e
    finally:
        client.close()
    return False


def _cluster_fields(client: redis.Redis) -> dict[str, str] | None:
    """CLUSTER INFO; None on a single server; `{}` when the ACL user may not ask (unknown:
    `auto` then takes a single server, `yes` trusts the setting)."""
    try:
        return cluster_info(client)
    except NoPermissionError:
        return {}
    except ResponseError:  # "cluster support disabled": a single server
        return None


def check_namespace(client: redis.Redis, namespace: str, url: str) -> None:
    """`FatalError` if the URL's ACL user may not read and write the namespace's keys.

    UNLINK of a name that never exists needs write access to the key and changes nothing.
    """
    try:
        client.exists(f"{namespace}:access-check")
        client.unlink(f"{namespace}:access-check")
    except NoPermissionError as e:
        user = urlsplit(url).username or "default"
        raise FatalError(
            f"Redis user {user!r} may not use namespace {namespace!r} (keys {namespace}:*): {e}"
        ) from e
    except RedisError as e:
        raise FatalError(f"Redis at {redacted(url)} cannot be used: {e}") from e


def sync_client(url: str, *, cluster: bool = False, **redis_kwargs: Any) -> redis.Redis:
    """A sync client for `url` whose commands are packed by `conn.SmallFirstPacker`
    (hiredis for small commands, redis-py's Python packer for MiB-size values).
    `redis_kwargs` go to the pool (e.g. `retry=`); closing the client closes it.
    With `cluster`, a `redis.cluster.RedisCluster` (its own pools per node; redis-py's
    default packer, since the cluster client takes no packer).
    """
    if cluster:
        try:
            return cast(redis.Redis, _SyncCluster.from_url(url, **redis_kwargs))
        except RedisClusterException as e:  # not a RedisError: say it as one line too
            raise FatalError(f"Redis Cluster at {redacted(url)}: {e}") from e
    if is_sentinel_url(url):
        client = sync_primary(url, **redis_kwargs)
        use_small_first(client.connection_pool)
        return client
    pool = redis.ConnectionPool.from_url(url, **redis_kwargs)
    use_small_first(pool)
    return redis.Redis.from_pool(pool)


class _SyncCluster(redis.cluster.RedisCluster):
    """redis-py's cluster client, whose stream reads find their node without asking one
    (`conn.read_stream`)."""

    def determine_slot(self, *args: Any) -> int | None:
        stream = read_stream(args)
        base: Any = super()  # (redis-py's sync cluster client is untyped)
        slot = base.keyslot(stream) if stream is not None else base.determine_slot(*args)
        return cast(int | None, slot)

    def close(self) -> None:
        """redis-py's `close` leaves a connection of a node's pool open after some commands
        (one socket per client, found by the tests' garbage collection): every node's pool
        is disconnected first."""
        untyped: Any = self  # (redis-py's sync cluster client is untyped)
        for node in untyped.get_nodes():
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()
        super().close()


@contextlib.contextmanager
def _closed_under_the_command() -> Iterator[None]:
    """redis-py's asyncio cluster client closes every connection it has (`aclose`) when a
    command meets CLUSTERDOWN or an uncovered slot, midway through other tasks' commands;
    one whose connection was closed under it fails with AttributeError (its writer or
    reader is gone). That is a lost connection: raise it as one, so that every loop that
    rides out Redis's failures rides this out too, instead of dying in a failover."""
    try:
        yield
    except AttributeError as e:
        if "'NoneType' object has no attribute" not in str(e):
            raise
        raise RedisConnectionError(f"connection closed under the command ({e})") from e


class _ClusterPipeline(aiocluster.ClusterPipeline):
    async def execute(
        self, raise_on_error: bool = True, allow_redirections: bool = True
    ) -> list[Any]:
        with _closed_under_the_command():
            return await super().execute(raise_on_error, allow_redirections)


_new_pipeline: Callable[..., aiocluster.ClusterPipeline] = _ClusterPipeline
"""(redis-py's typing calls ClusterPipeline abstract; it is built just as redis-py does.)"""


class _Cluster(StreamRoutedCluster):
    """redis-py's asyncio cluster client whose failures are RedisErrors, even in a failover
    (`_closed_under_the_command`), and whose stream reads find their node without asking."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        with _closed_under_the_command():
            return await super().execute_command(*args, **kwargs)

    def pipeline(
        self, transaction: Any | None = None, shard_hint: Any | None = None
    ) -> aiocluster.ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _new_pipeline(self, transaction)


def async_client(url: str, *, cluster: bool = False) -> aioredis.Redis:
    """An asyncio client for `url` (a cluster one with `cluster`; it connects lazily), its
    commands packed as `sync_client`'s are."""
    if cluster:
        return cast(aioredis.Redis, _Cluster.from_url(url))
    client = async_primary(url) if is_sentinel_url(url) else aioredis.Redis.from_url(url)
    use_small_first_async(client.connection_pool)
    return client


def pool_for_key(client: redis.Redis, key: str) -> ConnectionPool:
    """The connection pool of the server holding `key`: a plain client's own pool, or the
    pool of the cluster node that serves the key's slot (for a connection kept apart)."""
    if isinstance(client, redis.cluster.RedisCluster):
        node = client.get_node_from_key(key)
        return cast(ConnectionPool, client.get_redis_connection(node).connection_pool)
    return client.connection_pool


@dataclass(frozen=True)
class RedisClients:
    """Factories of the sync and async clients of one Redis (or one Redis Cluster)."""

    sync: Callable[[], redis.Redis]
    aio: Callable[[], aioredis.Redis]
    cluster: bool = False

    @classmethod
    def from_url(cls, url: str, cluster: ClusterMode = "auto") -> RedisClients:
        """Ask the server what it is (`probe`), then build clients of that kind."""
        clustered = probe(url, cluster)
        return cls(
            sync=lambda: sync_client(url, cluster=clustered),
            aio=lambda: async_client(url, cluster=clustered),
            cluster=clustered,
        )

    @classmethod
    def connect(cls, url: str | None, cluster: ClusterMode, namespace: str) -> RedisClients:
        """`from_url` for the deployment's URL and cluster mode (`OMNI_REDIS_URL`,
        `OMNI_REDIS_CLUSTER`), and the ACL check of its namespace (`OMNI_NAMESPACE`)."""
        if url is None:
            raise ConfigError(NO_REDIS_URL)
        clients = cls.from_url(url, cluster)
        client = clients.sync()
        try:
            check_namespace(client, namespace, url)
        finally:
            client.close()
        return clients
