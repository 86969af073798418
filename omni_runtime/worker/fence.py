"""Fencing a replica that stalled: it must not publish for inputs another replica claimed.

Another replica claims this one's pending inputs only once its heartbeat key has
expired, a TTL after its last successful beat. Until then (less a safety margin for
clock rates) every input it holds is its own. Past that — a stall (SIGSTOP, swap, a
long pause) or an unreachable Redis — the output thread holds its writes until the
heartbeat thread has beaten again and read which inputs are still in this consumer's
pending list (`Ownership`); the scheduler drops the others unpublished
(`WorkerCore.on_ownership`), then the fence opens. What the stalled replica queued for them is never written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from omni_runtime import keys
from omni_runtime.worker.actions import Ownership, stream_id

SAFE_SHARE = 0.8
"""Share of the heartbeat TTL after a beat during which writes need no check."""
PENDING_LIMIT = 100_000
"""Pending entries read at once: every replica's inputs in flight, far below this."""


class StallFence:
    """The worker's write fence: shared by the heartbeat thread (renews it), the scheduler
    (confirms a check) and the output thread (waits on it before each write). A thread's
    `liveness.Fence`: `fresh` as the orchestrator's leases say it, waited on by
    `wait_writable` instead of an `await`."""

    def __init__(self, ttl_s: float) -> None:
        self.window_s = ttl_s * SAFE_SHARE
        self._cv = threading.Condition()
        self._renewed_at = time.monotonic()
        self._checking = 0

    def renew(self, beat_started: float) -> bool:
        """After a successful beat that started at `beat_started`. True: the previous
        renewal is too old, inputs may have been claimed meanwhile; writes hold until
        `confirmed` (the caller must check ownership and hand it to the scheduler)."""
        with self._cv:
            if not self._checking and beat_started - self._renewed_at <= self.window_s:
                self._renewed_at = beat_started
                self._cv.notify_all()
                return False
            self._checking += 1
            return True

    def confirmed(self, beat_started: float) -> None:
        """The scheduler dropped what is no longer ours, as of the beat at `beat_started`."""
        with self._cv:
            self._checking -= 1
            self._renewed_at = max(self._renewed_at, beat_started)
            self._cv.notify_all()

    def fresh(self) -> bool:
        with self._cv:
            return self._open()

    def wait_writable(self, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(self._open, timeout_s)

    def _open(self) -> bool:
        return not self._checking and time.monotonic() - self._renewed_at < self.window_s


def read_ownership(client: redis.Redis, stream: str, consumer: str) -> Ownership:
    """The workers' group's pending list and last delivered id, in one transaction."""
    with client.pipeline(transaction=True) as pipe:
        pipe.xinfo_groups(stream)
        pipe.xpending_range(stream, keys.WORKERS_GROUP, min="-", max="+", count=PENDING_LIMIT)
        groups, rows = pipe.execute()
    last = next(
        (
            _field(g, "last-delivered-id")
            for g in groups
            if _text(_field(g, "name")) == keys.WORKERS_GROUP
        ),
        b"0-0",
    )
    mine: set[bytes] = set()
    others: set[bytes] = set()
    for row in rows:
        eid, owner = _pending_row(row)
        eid = eid if isinstance(eid, bytes) else str(eid).encode()
        (mine if _text(owner) == consumer else others).add(eid)
    return Ownership(frozenset(mine), frozenset(others), stream_id(_text(last).encode()))


# A Redis Cluster client's transaction leaves replies half parsed (redis-py): XINFO
# GROUPS's fields are bytes, XPENDING's rows are [id, consumer, idle, deliveries] lists.


def _field(group: dict[Any, Any], name: str) -> Any:
    return group[name] if name in group else group[name.encode()]


def _pending_row(row: Any) -> tuple[Any, Any]:
    if isinstance(row, dict):
        return row["message_id"], row["consumer"]
    return row[0], row[1]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class StallGuard:
    """The fence's three sides: after each beat (heartbeat thread) it checks ownership when
    the fence asks; the scheduler applies the result (`apply`); the output thread waits on
    `fence`."""

    def __init__(
        self, client: redis.Redis, stream: str, consumer: str, ttl_s: float, wake: threading.Event
    ) -> None:
        self.fence = StallFence(ttl_s)
        self.client = client
        self.stream = stream
        self.consumer = consumer
        self._wake = wake
        self._lock = threading.Lock()
        self._checks: list[tuple[float, Ownership]] = []

    def after_beat(self, beat_started: float) -> None:
        if not self.fence.renew(beat_started):
            return
        owned: Ownership | None = None
        try:
            owned = read_ownership(self.client, self.stream, self.consumer)
        finally:
            if owned is None:  # failed: the fence stays closed, the next beat checks again
                self.fence.confirmed(float("-inf"))
        with self._lock:
            self._checks.append((beat_started, owned))
        self._wake.set()

    def apply(
        self,
        on_ownership: Callable[[Ownership], list[str]],
        forget: Callable[[set[str], Ownership], None],
    ) -> bool:
        """Scheduler side: drop what another replica claimed, then open the fence."""
        with self._lock:
            checks, self._checks = self._checks, []
        for checked_at, ownership in checks:
            forget(set(on_ownership(ownership)), ownership)
            self.fence.confirmed(checked_at)
        return bool(checks)
