"""In-process connector: the ChunkAdapter's data plane as a locked dict (tests, one-process runs).

Values are stored as-is, not serialised. That is safe because the ChunkAdapter
puts only values it built itself from a snapshot of the stage's object (SPEC §4):
nothing else holds a reference that could mutate a value between `put` and
`get`, and `get` hands the one stored object to exactly one reader.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any


class MemoryConnector:
    """Thread-safe `put` / consume-once `get` over a dict guarded by one lock.

    `puts` records every key put, in order (the SPEC's seed examples check it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: dict[str, Any] = {}
        self.puts: list[str] = []
        self._callbacks: list[Callable[[str], None]] = []

    def put(self, key: str, obj: Any) -> None:
        """Store `obj` under `key` (replacing any unread value)."""
        with self._lock:
            self._store[key] = obj
            self.puts.append(key)
            callbacks = list(self._callbacks)
        route_id = key.rsplit("_", 1)[0]
        for callback in callbacks:
            callback(route_id)

    def put_many(self, items: Sequence[tuple[str, Any]]) -> None:
        """`put` each item, all under one lock acquisition (all or nothing)."""
        with self._lock:
            for key, obj in items:
                self._store[key] = obj
                self.puts.append(key)
            callbacks = list(self._callbacks)
        for route_id in dict.fromkeys(key.rsplit("_", 1)[0] for key, _obj in items):
            for callback in callbacks:
                callback(route_id)

    def get(self, key: str) -> Any | None:
        """Remove and return the value under `key`; `None` when it is not there (yet)."""
        with self._lock:
            return self._store.pop(key, None)

    def get_many(self, keys: Sequence[str]) -> list[Any | None]:
        """`get` for each key under one lock acquisition; the result is aligned with `keys`."""
        with self._lock:
            return [self._store.pop(key, None) for key in keys]

    def peek_many(self, keys: Sequence[str], delete_first: Sequence[str] = ()) -> list[Any | None]:
        """The values under `keys` (or `None`), left in place; `delete_first` are dropped before."""
        with self._lock:
            for key in delete_first:
                self._store.pop(key, None)
            return [self._store.get(key) for key in keys]

    def on_put(self, callback: Callable[[str], None]) -> None:
        """Call `callback(<req>_<stage>)` after every put: receivers block instead of polling."""
        with self._lock:
            self._callbacks.append(callback)

    def listen(self, route_ids: Sequence[str]) -> None:
        """Nothing to register: every put already calls every callback."""

    def unlisten(self, route_ids: Sequence[str]) -> None:
        """See `listen`."""

    def delete_many(self, keys: Iterable[str]) -> None:
        """Drop every listed key that exists; missing keys are ignored."""
        with self._lock:
            for key in keys:
                self._store.pop(key, None)

    def __len__(self) -> int:
        """Number of values stored and not yet consumed."""
        with self._lock:
            return len(self._store)
