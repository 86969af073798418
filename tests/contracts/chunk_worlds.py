"""The chunk plane's implementations as test worlds: memory (wake-ups), polling (a SPEC
connector lifted by PollingTransport), Redis on fakeredis, on a real redis-server and on a
real Redis Cluster.

A `World` makes one transport per adapter (as in one process per stage), all on
one store, each wrapped in a `Recording` that records puts and can hold or fail
reads, so every SPEC §4 rule is checked against every implementation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import fakeredis
import pytest
import redis

from omni_runtime import ChunkAdapter
from omni_runtime.chunks import MemoryConnector, PollingTransport, RedisConnector
from omni_runtime.chunks.transport import ChunkTransport, Fetched, PutItem
from omni_runtime.keys import stored_chunk_key
from omni_runtime.redis_io.clients import sync_client
from omni_runtime.wire import codec
from tests.backends import REAL_REDIS_FIXTURES

REAL = pytest.param("redis-server", marks=pytest.mark.redis_server)
CLUSTER = pytest.param("redis-cluster", marks=pytest.mark.redis_server)
KINDS = ["memory", "polling", "fakeredis", REAL, CLUSTER]
PREFIX = "t:"


class Recording:
    """A `ChunkTransport` around another: records every put; can hold the fetch that reads
    `hold_key` (after reading, before returning) and fail the next `fail_fetches` fetches."""

    def __init__(self, inner: ChunkTransport, log: list[tuple[str, Any]]) -> None:
        self.inner = inner
        self.max_batch = inner.max_batch
        self.signals_puts = inner.signals_puts
        self.log = log
        self.hold_key: str | None = None
        self.in_fetch = threading.Event()
        self.release = threading.Event()
        self.fail_fetches = 0

    def put_batch(self, items: Sequence[PutItem]) -> None:
        """Recorded first (a reader may see the value before `put_batch` returns), and
        taken back if the put fails."""
        entries = [(key, value) for key, value, _last in items]
        self.log.extend(entries)
        try:
            self.inner.put_batch(items)
        except BaseException:
            for entry in entries:
                self.log.remove(entry)
            raise

    def fetch(self, keys: Sequence[str]) -> list[Fetched]:
        if self.fail_fetches > 0:
            self.fail_fetches -= 1
            raise OSError("connection reset")
        values = self.inner.fetch(keys)
        if self.hold_key is not None and self.hold_key in keys:
            self.hold_key = None
            self.in_fetch.set()
            assert self.release.wait(10)
        return values

    def discard(self, keys: Sequence[str]) -> int:
        return self.inner.discard(keys)

    def subscribe(self, route_ids: Sequence[str]) -> None:
        self.inner.subscribe(route_ids)

    def unsubscribe(self, route_ids: Sequence[str]) -> None:
        self.inner.unsubscribe(route_ids)

    def wait_for_puts(self, timeout_s: float) -> dict[str, int]:
        return self.inner.wait_for_puts(timeout_s)

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()


class World:
    """One store, and transports on it for as many adapters as a test makes."""

    def __init__(self, kind: str, url: str | None = None) -> None:
        self.kind = kind
        self.url = url
        self.log: list[tuple[str, Any]] = []
        self.made: list[Any] = []
        self.adapters: list[ChunkAdapter] = []
        self.store = MemoryConnector()
        self.server = fakeredis.FakeServer()
        self.cluster = kind == "redis-cluster"
        self.raw: redis.Redis = (
            sync_client(url, cluster=self.cluster)
            if url
            else fakeredis.FakeRedis(server=self.server)
        )
        self.side = self._redis() if kind not in ("memory", "polling") else None
        """A second connector on the store: puts as another process would."""

    def _redis(self) -> RedisConnector:
        if self.url is not None:
            conn = RedisConnector.from_url(self.url, prefix=PREFIX, cluster=self.cluster)
        else:
            conn = RedisConnector(fakeredis.FakeRedis(server=self.server), prefix=PREFIX)
        self.made.append(conn)
        return conn

    def transport(self) -> Recording:
        inner: ChunkTransport
        if self.kind == "memory":
            inner = MemoryConnector(share=self.store)
        elif self.kind == "polling":
            inner = PollingTransport(self.store)
        else:
            inner = self._redis()
        return Recording(inner, self.log)

    def adapter(self, stage_id: int, **kw: Any) -> tuple[ChunkAdapter, Recording]:
        t = self.transport()
        adapter = ChunkAdapter(t, stage_id, **kw)
        self.adapters.append(adapter)
        return adapter, t

    @property
    def puts(self) -> list[str]:
        return [key for key, _v in self.log]

    def put_keys(self, prefix: str) -> list[str]:
        return [k for k in self.puts if k.startswith(prefix)]

    def put_values(self, prefix: str) -> list[Any]:
        return [v for k, v in self.log if k.startswith(prefix)]

    def put(self, key: str, value: Any) -> None:
        """A put from outside any adapter (with wake-ups where the store has them)."""
        if self.side is not None:
            self.side.put(key, value)
        else:
            self.store.put(key, value)

    def put_garbage(self, key: str) -> None:
        """A value no decoder accepts (memory: a value that is not a chunk)."""
        if self.side is not None:
            self.raw.set(stored_chunk_key(key, PREFIX), b"\xc1\xc1 not msgpack")
        else:
            self.store.put(key, {"unexpected": 1})

    def present(self, prefix: str, upto: int = 200) -> list[str]:
        """Which of `<prefix>0 .. <prefix>upto-1` are stored now (without consuming)."""
        candidates = [f"{prefix}{i}" for i in range(upto)]
        if self.side is None:
            return [k for k in candidates if k in self.store]
        return [k for k in candidates if self.raw.exists(stored_chunk_key(k, PREFIX))]

    def left(self) -> int:
        """Chunk values stored and not consumed."""
        if self.side is None:
            return len(self.store)
        # SCAN, not KEYS: a cluster client sends KEYS to one node, SCAN to every primary
        names = [k for k in self.raw.scan_iter(PREFIX + "*") if b":notify:" not in k]
        return len([k for k in names if b"route:" not in k])

    def close(self) -> None:
        for adapter in self.adapters:
            adapter.stop()
        for conn in self.made:
            conn.close()
            conn.client.close()
        self.raw.close()


def encoded_size(value: Any) -> int:
    return len(codec.encode(value))


def _world(request: pytest.FixtureRequest) -> Iterator[World]:
    fixture = REAL_REDIS_FIXTURES.get(request.param)
    url = request.getfixturevalue(fixture) if fixture else None
    w = World(request.param, url)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(params=KINDS)
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    yield from _world(request)


@pytest.fixture(params=["fakeredis", REAL, CLUSTER])
def redis_world(request: pytest.FixtureRequest) -> Iterator[World]:
    """The worlds whose transport is the Redis one, for what only it promises."""
    yield from _world(request)
