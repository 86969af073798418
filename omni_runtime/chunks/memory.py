"""The chunk plane in one process: a locked dict that is both a SPEC connector and a
`ChunkTransport` with wake-ups.

Values are stored as-is, not serialised. That is safe because the ChunkAdapter
puts only values it built itself from a snapshot of the stage's object (SPEC §4):
nothing else holds a reference that could mutate a value between `put` and
`get`, and `get` hands the one stored object to exactly one reader.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

from omni_runtime.chunks.transport import Fetched, PutItem, route_and_id


class _Store:
    """The values, shared by every `MemoryConnector` made on it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, Any] = {}
        self.puts: list[str] = []
        self.views: list[MemoryConnector] = []


class MemoryConnector:
    """Thread-safe `put` / consume-once `get` (SPEC §2) and the `ChunkTransport` surface.

    `MemoryConnector(share=other)` is a second view on `other`'s values, as a
    second process would have: each view has its own subscriptions and wake-ups
    (one receiving adapter per view). `puts` records every key put, in order.
    """

    max_batch = 64
    signals_puts = True

    def __init__(self, share: MemoryConnector | None = None) -> None:
        self._store: _Store = share._store if share is not None else _Store()
        self._cv = threading.Condition()
        self._subscribed: set[str] = set()
        self._woken: dict[str, int] = {}
        self._kicked = False
        with self._store.lock:
            self._store.views.append(self)

    @property
    def puts(self) -> list[str]:
        return self._store.puts

    # --- SPEC connector ---------------------------------------------------------

    def put(self, key: str, obj: Any) -> None:
        """Store `obj` under `key` (replacing any unread value)."""
        self._put_all([(key, obj)])

    def get(self, key: str) -> Any | None:
        """Remove and return the value under `key`; `None` when it is not there (yet)."""
        with self._store.lock:
            return self._store.values.pop(key, None)

    # --- ChunkTransport -----------------------------------------------------------

    def put_batch(self, items: Sequence[PutItem]) -> None:
        """Every item under one lock acquisition (all or nothing), then the wake-ups."""
        self._put_all([(key, value) for key, value, _last in items])

    def fetch(self, keys: Sequence[str]) -> list[Fetched]:
        with self._store.lock:
            return [self._store.values.pop(key, None) for key in keys]

    def discard(self, keys: Sequence[str]) -> int:
        return sum(v is not None for v in self.fetch(keys))

    def subscribe(self, route_ids: Sequence[str]) -> None:
        with self._cv:
            self._subscribed.update(route_ids)

    def unsubscribe(self, route_ids: Sequence[str]) -> None:
        with self._cv:
            self._subscribed.difference_update(route_ids)
            for route_id in route_ids:
                self._woken.pop(route_id, None)

    def wait_for_puts(self, timeout_s: float) -> dict[str, int]:
        with self._cv:
            if not self._woken and not self._kicked and timeout_s > 0:
                self._cv.wait(timeout_s)
            woken, self._woken, self._kicked = self._woken, {}, False
        return woken

    def wake(self) -> None:
        with self._cv:
            self._kicked = True
            self._cv.notify_all()

    def close(self) -> None:
        """Stop taking wake-ups; the values stay for the other views."""
        with self._store.lock:
            if self in self._store.views:
                self._store.views.remove(self)

    # --- inspection ---------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        """Whether a value is stored under `key` (without consuming it)."""
        with self._store.lock:
            return key in self._store.values

    def __len__(self) -> int:
        """Number of values stored and not yet consumed."""
        with self._store.lock:
            return len(self._store.values)

    def _put_all(self, items: list[tuple[str, Any]]) -> None:
        with self._store.lock:
            for key, obj in items:
                self._store.values[key] = obj
                self._store.puts.append(key)
            views = list(self._store.views)
        put = [route_and_id(key) for key, _obj in items]
        for view in views:
            view._seen(put)

    def _seen(self, put: Iterable[tuple[str, int]]) -> None:
        """A put on the store (any view, any thread): wake our wait if we listen."""
        with self._cv:
            hit = False
            for route_id, chunk_id in put:
                if route_id in self._subscribed:
                    self._woken[route_id] = max(chunk_id, self._woken.get(route_id, -1))
                    hit = True
            if hit:
                self._cv.notify_all()
