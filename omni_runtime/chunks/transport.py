"""What the ChunkAdapter moves chunks through: two declared protocols and the lift between them.

`Connector` is the SPEC §2 minimum (`put`, consuming `get`). `ChunkTransport`
is the whole surface the adapter's threads use; the adapter decides once, at
construction, which one it was given, and lifts a bare `Connector` with
`PollingTransport`, so its threads have one code path. The calls go one way:
a transport never calls back into the adapter.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from omni_runtime.core.types import Connector, MalformedChunk

__all__ = [
    "ChunkRejected",
    "ChunkTransport",
    "Connector",
    "Fetched",
    "MalformedChunk",
    "PollingTransport",
    "PutItem",
    "route_and_id",
]

PutItem = tuple[str, Any, bool]
"""(key, value, last of its route): a transport may forget a route after its last put."""
Fetched = Any
"""A value read, `None` (not there yet), or a `MalformedChunk` (read, consumed, unusable)."""


def route_and_id(key: str) -> tuple[str, int]:
    """`<req>_<stage>_<id>` → (`<req>_<stage>`, id); a key without a numeric id reports -1."""
    route, _, chunk_id = key.rpartition("_")
    return route, int(chunk_id) if chunk_id.isdigit() else -1


class ChunkRejected(Exception):
    """`put_batch` stored nothing because these items cannot be stored (key → reason),
    e.g. they fail to encode or exceed the size limit; the others may be put again."""

    def __init__(self, rejected: dict[str, str]) -> None:
        super().__init__(f"{len(rejected)} chunk(s) rejected: {rejected}")
        self.rejected = rejected


@runtime_checkable
class ChunkTransport(Protocol):
    """The chunk plane as the adapter's SAVE and RECV threads use it (one receiver each)."""

    max_batch: int
    """Most items one `put_batch` stores all or nothing."""
    signals_puts: bool
    """Whether `wait_for_puts` reports puts: if not, the receiver polls every request."""

    def put_batch(self, items: Sequence[PutItem]) -> None:
        """Store every item, or none (raises; `ChunkRejected` names the items at fault)."""
        ...

    def fetch(self, keys: Sequence[str]) -> list[Fetched]:
        """Read and consume `keys`, aligned with them."""
        ...

    def discard(self, keys: Sequence[str]) -> int:
        """Delete whichever of `keys` exist; how many did."""
        ...

    def subscribe(self, route_ids: Sequence[str]) -> None:
        """Report puts of these `<req>_<stage>` routes from `wait_for_puts`."""
        ...

    def unsubscribe(self, route_ids: Sequence[str]) -> None: ...

    def wait_for_puts(self, timeout_s: float) -> dict[str, int]:
        """Block up to `timeout_s` (or until `wake`) for puts; the routes put since last
        time, each with the highest chunk id put (so the reader reads up to it, no further)."""
        ...

    def wake(self) -> None:
        """From any thread, at once and without I/O: end a `wait_for_puts` early."""
        ...

    def close(self) -> None: ...


class PollingTransport:
    """Any SPEC connector as a `ChunkTransport`: one put at a time, `get` per key, and no
    wake-ups (the receiver pauses ~1 ms between rounds that found nothing)."""

    max_batch = 1
    signals_puts = False

    def __init__(self, connector: Connector) -> None:
        self.connector = connector
        self._kick = threading.Event()

    def put_batch(self, items: Sequence[PutItem]) -> None:
        for key, value, _last in items:  # max_batch = 1: all or nothing holds
            self.connector.put(key, value)

    def fetch(self, keys: Sequence[str]) -> list[Fetched]:
        return [self.connector.get(key) for key in keys]

    def discard(self, keys: Sequence[str]) -> int:
        """Consuming is deleting: `get` each key."""
        return sum(self.connector.get(key) is not None for key in keys)

    def subscribe(self, route_ids: Sequence[str]) -> None:
        """Nothing to register: the receiver polls."""

    def unsubscribe(self, route_ids: Sequence[str]) -> None:
        """See `subscribe`."""

    def wait_for_puts(self, timeout_s: float) -> dict[str, int]:
        if self._kick.wait(timeout_s):
            self._kick.clear()
        return {}

    def wake(self) -> None:
        self._kick.set()

    def close(self) -> None:
        """The connector belongs to the caller."""
