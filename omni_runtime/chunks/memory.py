"""The chunk plane in one process: a SPEC connector over a dict, and a transport with wake-ups.

Values are stored as-is, not serialised. That is safe because the ChunkAdapter
puts only values it built itself from a snapshot of the stage's object (SPEC §4):
nothing else holds a reference that could mutate a value between `put` and
`get`, and `get` hands the one stored object to exactly one reader.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

from omni_runtime import keys
from omni_runtime.chunks.transport import Fetched, PutItem


class MemoryConnector:
    """Thread-safe `put` / consume-once `get` (SPEC §2) over a dict guarded by one lock.

    `puts` records every key put, in order (the SPEC's seed examples check it).
    Several `MemoryTransport`s may share one connector as their store.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: dict[str, Any] = {}
        self.puts: list[str] = []
        self._transports: list[MemoryTransport] = []

    def put(self, key: str, obj: Any) -> None:
        """Store `obj` under `key` (replacing any unread value)."""
        self.put_all([(key, obj)])

    def get(self, key: str) -> Any | None:
        """Remove and return the value under `key`; `None` when it is not there (yet)."""
        with self._lock:
            return self._store.pop(key, None)

    def put_all(self, items: Iterable[tuple[str, Any]]) -> None:
        """Store every item under one lock acquisition (all or nothing), then wake listeners."""
        with self._lock:
            routes: dict[str, None] = {}
            for key, obj in items:
                self._store[key] = obj
                self.puts.append(key)
                routes[keys.route_of_chunk_key(key)] = None
            transports = list(self._transports)
        for transport in transports:
            transport.put_seen(routes)

    def get_all(self, keys: Sequence[str]) -> list[Any | None]:
        """`get` for each key under one lock acquisition; aligned with `keys`."""
        with self._lock:
            return [self._store.pop(key, None) for key in keys]

    def attach(self, transport: MemoryTransport) -> None:
        with self._lock:
            self._transports.append(transport)

    def detach(self, transport: MemoryTransport) -> None:
        with self._lock:
            if transport in self._transports:
                self._transports.remove(transport)

    def __contains__(self, key: object) -> bool:
        """Whether a value is stored under `key` (without consuming it)."""
        with self._lock:
            return key in self._store

    def __len__(self) -> int:
        """Number of values stored and not yet consumed."""
        with self._lock:
            return len(self._store)


class MemoryTransport:
    """A `ChunkTransport` over a `MemoryConnector` (its own, or one shared with others):
    puts of subscribed routes wake `wait_for_puts` at once."""

    max_batch = 64
    signals_puts = True

    def __init__(self, store: MemoryConnector | None = None) -> None:
        self.store = store if store is not None else MemoryConnector()
        self._cv = threading.Condition()
        self._subscribed: set[str] = set()
        self._woken: set[str] = set()
        self._kicked = False
        self.store.attach(self)

    def put_batch(self, items: Sequence[PutItem]) -> None:
        self.store.put_all((key, value) for key, value, _last in items)

    def fetch(self, keys: Sequence[str]) -> list[Fetched]:
        return self.store.get_all(keys)

    def discard(self, keys: Sequence[str]) -> int:
        return sum(v is not None for v in self.store.get_all(keys))

    def subscribe(self, route_ids: Sequence[str]) -> None:
        with self._cv:
            self._subscribed.update(route_ids)

    def unsubscribe(self, route_ids: Sequence[str]) -> None:
        with self._cv:
            self._subscribed.difference_update(route_ids)
            self._woken.difference_update(route_ids)

    def put_seen(self, route_ids: Iterable[str]) -> None:
        """Called by the store after a put (any thread): wake the wait if we listen."""
        with self._cv:
            hit = self._subscribed.intersection(route_ids)
            if hit:
                self._woken |= hit
                self._cv.notify_all()

    def wait_for_puts(self, timeout_s: float) -> set[str]:
        with self._cv:
            if not self._woken and not self._kicked and timeout_s > 0:
                self._cv.wait(timeout_s)
            woken, self._woken, self._kicked = self._woken, set(), False
        return woken

    def wake(self) -> None:
        with self._cv:
            self._kicked = True
            self._cv.notify_all()

    def close(self) -> None:
        self.store.detach(self)

    def __len__(self) -> int:
        return len(self.store)
