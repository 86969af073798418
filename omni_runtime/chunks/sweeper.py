"""Deleting the unread chunks of discarded requests, for the RECV half of the ChunkAdapter.

A `ChunkSweeper` is owned by one `ChunkReceiver`: it shares the receiver's
Condition as its lock, is scheduled from `ChunkReceiver.discard` (under that
lock) and runs on the receiver's RECV thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from omni_runtime import keys

log = logging.getLogger(__name__)

LATE_SWEEP_S = 1.0
"""A discarded request's unread chunks are deleted at once and again this much later,
for chunks its upstream put while the discard was under way."""

_KeysCall = Callable[[Sequence[str]], None]
"""An optional connector method taking a list of keys or route ids (`delete_many`, `listen`)."""


class _PeekMany(Protocol):
    """`peek_many(keys, delete_first=())`: read without consuming, delete `delete_first` before."""

    def __call__(self, keys: Sequence[str], delete_first: Sequence[str] = ..., /) -> list[Any]: ...


class ChunkSweeper:
    """The sweeps of one receiver: its discarded requests' unread chunk keys, deleted when due."""

    def __init__(
        self,
        lock: threading.Condition,
        src_stage_id: int,
        peek_many: _PeekMany | None,
        delete_many: _KeysCall | None,
    ) -> None:
        self._lock = lock
        """The owning receiver's `_recv_cv`: guards `_sweeps`."""
        self.src_stage_id = src_stage_id
        self._peek_many = peek_many
        self._delete_many = delete_many
        self._sweeps: list[tuple[float, str, int]] = []
        """(due, request, first unread id): unread chunks of discarded requests to delete."""

    def schedule(self, request_id: str, first_unread_id: int) -> None:
        """Caller holds the lock: sweep the request's chunks from `first_unread_id` on,
        now and once more `LATE_SWEEP_S` later. A connector that cannot peek and delete gets
        no sweeps: its chunks expire by their TTL."""
        if self._peek_many is None or self._delete_many is None:
            return
        now = time.monotonic()
        self._sweeps.extend(
            [(now, request_id, first_unread_id), (now + LATE_SWEEP_S, request_id, first_unread_id)]
        )

    def next_due(self) -> float | None:
        """Caller holds the lock: when the earliest sweep is due, or None with none scheduled."""
        return min((d for d, _r, _i in self._sweeps), default=None)

    def run_due(self) -> None:
        """Delete the unread chunks of discarded requests, page by page while pages are full."""
        if not self._sweeps or self._peek_many is None or self._delete_many is None:
            return
        now = time.monotonic()
        with self._lock:
            due = [sw for sw in self._sweeps if sw[0] <= now]
            self._sweeps = [sw for sw in self._sweeps if sw[0] > now]
        for _due, rid, first in due:
            try:
                while True:
                    page = [keys.chunk_key(rid, self.src_stage_id, first + i) for i in range(64)]
                    found = [
                        k for k, v in zip(page, self._peek_many(page), strict=True) if v is not None
                    ]
                    if found:
                        self._delete_many(found)
                    if len(found) < len(page):
                        break
                    first += len(page)
            except Exception as e:
                log.warning(
                    "deleting unread chunks of discarded %r failed (they expire): %r", rid, e
                )
