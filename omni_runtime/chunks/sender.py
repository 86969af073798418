"""The SAVE half of the ChunkAdapter (SPEC §4): snapshot on the caller, build + put on one thread.

`save_async`, `cancel_sender` and `discard` only touch in-memory structures
under a lock and return at once. One SAVE thread does all building and putting:
one FIFO keeps each request's chunks ordered and its ids contiguous from 0.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from omni_runtime import keys
from omni_runtime.core.types import Connector

log = logging.getLogger(__name__)

Chunk = dict[str, Any]
"""Exactly `{"data": payload, "finished": is_final}`."""
_PURGE = object()
"""A SAVE-queue item that deletes a discarded request's keys once its final went out."""

IDLE_WAIT_S = 0.1
"""Longest sleep on the Condition: a lost notification costs at most this much."""
PUT_BATCH = 64
"""Most chunks one all-or-nothing put carries when more are queued (connectors with put_many)."""


class ChunkSender:
    """Puts a stage's chunks under `stage_id`'s keys, from its own SAVE thread."""

    def __init__(
        self,
        connector: Connector,
        stage_id: int,
        build_payload: Callable[[Any], Any] | None = None,
        snapshot: Callable[[Any], Any] = copy.deepcopy,
    ) -> None:
        self.connector = connector
        self.stage_id = stage_id
        self.build_payload: Callable[[Any], Any] = build_payload or (lambda snap: snap)
        self.snapshot = snapshot
        self._put_many: Callable[[list[tuple[str, Any]]], None] | None = getattr(
            connector, "put_many", None
        )
        self._put_batch = PUT_BATCH if self._put_many is not None else 1
        self._delete_many: Callable[[Sequence[str]], None] | None = getattr(
            connector, "delete_many", None
        )
        self._stop = threading.Event()
        # state guarded by _send_cv
        self._send_cv = threading.Condition()
        self._send_q: deque[tuple[str, Any, bool]] = deque()
        self._send_ids: dict[str, int] = {}
        self._send_pending: dict[str, int] = {}
        self._cancelled: set[str] = set()
        self._purge_wanted: set[str] = set()
        self._sent_upto: dict[str, int] = {}
        self._finals_pending: dict[str, int] = {}
        """Finals queued or being built, per request: `discard` adds one only if none is."""
        # counters, for logs and metrics
        self.sent_chunks = 0
        self.dropped_chunks = 0
        self.failed_puts = 0
        self.thread = threading.Thread(
            target=self._save_loop, name=f"chunk-save-{stage_id}", daemon=True
        )
        self.thread.start()

    # --- scheduler-thread API: in-memory only, returns at once ---------------

    def save_async(self, request_id: str, obj: Any, is_final: bool) -> None:
        """Snapshot `obj` now (later mutation must not leak) and queue it for the SAVE thread."""
        snap = self.snapshot(obj)
        with self._send_cv:
            self._send_q.append((request_id, snap, is_final))
            self._send_pending[request_id] = self._send_pending.get(request_id, 0) + 1
            if is_final:
                self._finals_pending[request_id] = self._finals_pending.get(request_id, 0) + 1
            self._send_cv.notify()

    def cancel_sender(self, request_id: str) -> None:
        """Drop the request's queued non-final chunks; its final still goes out with data None."""
        with self._send_cv:
            if request_id in self._send_pending or request_id in self._send_ids:
                self._cancelled.add(request_id)

    def discard(self, request_id: str) -> None:
        """Drop the request's queued chunks (a final with data None still goes out if it was
        mid-stream), then delete every chunk key of it this stage wrote. Returns at once."""
        with self._send_cv:
            if request_id in self._send_pending or request_id in self._send_ids:
                self._cancelled.add(request_id)
                if not self._finals_pending.get(request_id):
                    # (a final already queued or being built goes out with data None instead)
                    self._send_q.append((request_id, None, True))
                    self._send_pending[request_id] = self._send_pending.get(request_id, 0) + 1
                    self._finals_pending[request_id] = 1
            self._purge_wanted.add(request_id)
            self._send_q.append((request_id, _PURGE, True))
            self._send_cv.notify()

    def request_stop(self) -> None:
        """Signal the SAVE thread to stop, without waiting for it."""
        self._stop.set()
        with self._send_cv:
            self._send_cv.notify_all()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Wake the SAVE thread and join it; returns promptly even while it idles."""
        self.request_stop()
        self.thread.join(timeout_s)

    # --- SAVE thread: build + put only ----------------------------------------

    def _save_loop(self) -> None:
        """Build items one by one (each checked for cancel when its turn comes); put them
        together when more are queued, in one all-or-nothing round trip."""
        batch: list[tuple[str, str, Chunk]] = []
        staged_ids: dict[str, int] = {}
        while True:
            with self._send_cv:
                while not self._send_q and not batch and not self._stop.is_set():
                    self._send_cv.wait(IDLE_WAIT_S)
                if self._stop.is_set():
                    return
                item = self._send_q.popleft() if self._send_q else None
                cancelled = item is not None and item[0] in self._cancelled
            if item is not None and item[1] is _PURGE:
                if batch:
                    self._flush(batch)
                    batch, staged_ids = [], {}
                self._purge_sent(item[0])
                continue
            if item is not None:
                self._stage(batch, staged_ids, *item, cancelled)
            with self._send_cv:
                more = bool(self._send_q)
            if batch and (not more or len(batch) >= self._put_batch):
                self._flush(batch)
                batch, staged_ids = [], {}

    def _stage(
        self,
        batch: list[tuple[str, str, Chunk]],
        staged_ids: dict[str, int],
        request_id: str,
        snap: Any,
        is_final: bool,
        cancelled: bool,
    ) -> None:
        """Cancel check, build, and the key of the request's current id (counting the batch)."""
        if cancelled and not is_final:
            self.dropped_chunks += 1
            self._done_pending([request_id])
            return
        payload = None if cancelled else self._build(request_id, snap)
        if payload is None and not is_final:
            self._done_pending([request_id])
            return
        if request_id in staged_ids:
            chunk_id = staged_ids[request_id]
        else:
            with self._send_cv:
                chunk_id = self._send_ids.get(request_id, 0)
        staged_ids[request_id] = 0 if is_final else chunk_id + 1
        key = keys.chunk_key(request_id, self.stage_id, chunk_id)
        batch.append((request_id, key, {"data": payload, "finished": is_final}))

    def _flush(self, batch: list[tuple[str, str, Chunk]]) -> None:
        """Put the batch; only a successful put advances ids (all of the batch, or none)."""
        try:
            if len(batch) == 1 or self._put_many is None:
                self.connector.put(batch[0][1], batch[0][2])
            else:
                self._put_many([(key, chunk) for _r, key, chunk in batch])
            ok = True
        except Exception as e:
            ok = False
            self.failed_puts += len(batch)
            log.error("put of %d chunk(s) failed, dropped (%s ...): %r", len(batch), batch[0][1], e)
        with self._send_cv:
            for request_id, key, chunk in batch:
                if ok:
                    self.sent_chunks += 1
                    self._send_ids[request_id] = int(key.rsplit("_", 1)[1]) + 1
                if chunk["finished"]:
                    left = self._finals_pending.pop(request_id, 1) - 1
                    if left > 0:
                        self._finals_pending[request_id] = left
                    if request_id in self._purge_wanted:
                        upto = int(key.rsplit("_", 1)[1]) + 1
                        self._sent_upto[request_id] = max(upto, self._sent_upto.get(request_id, 0))
                    self._send_ids.pop(request_id, None)
                    self._cancelled.discard(request_id)
        self._done_pending([r for r, _k, _c in batch])

    def _purge_sent(self, request_id: str) -> None:
        """Delete every chunk key this stage wrote for the request (after its final went out)."""
        with self._send_cv:
            self._purge_wanted.discard(request_id)
            upto = self._sent_upto.pop(request_id, None)
            if upto is None:
                upto = self._send_ids.pop(request_id, 0)
            self._cancelled.discard(request_id)
        if upto and self._delete_many is not None:
            try:
                self._delete_many(
                    [keys.chunk_key(request_id, self.stage_id, i) for i in range(upto)]
                )
            except Exception as e:
                log.warning(
                    "deleting the chunks of aborted %r failed (they expire): %r", request_id, e
                )

    def _done_pending(self, request_ids: list[str]) -> None:
        with self._send_cv:
            for request_id in request_ids:
                left = self._send_pending.get(request_id, 1) - 1
                if left > 0:
                    self._send_pending[request_id] = left
                else:
                    self._send_pending.pop(request_id, None)

    def _build(self, request_id: str, snap: Any) -> Any:
        """Call the user's `build_payload` outside every lock; a failure skips the chunk."""
        try:
            return self.build_payload(snap)
        except Exception:
            log.exception("build_payload failed for %r; chunk skipped", request_id)
            return None
