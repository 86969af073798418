"""The SAVE half of the ChunkAdapter (SPEC §4): one thread looping over a `SendBook`.

The caller's side (`save_async`, `cancel_sender`, `discard`) only touches the
book under the lock. The SAVE thread takes items in FIFO order, checks the
cancel mark at each item's turn, builds outside the lock, and puts what it
built in all-or-nothing batches when more is queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from omni_runtime import keys
from omni_runtime.chunks.snapshot import snapshot as snapshot_tree
from omni_runtime.chunks.transport import ChunkRejected, ChunkTransport
from omni_runtime.core import foreign
from omni_runtime.core.chunk_book import SendBook, SendItem, Staged
from omni_runtime.core.foreign import Raised
from omni_runtime.observe.metrics import Metrics

log = logging.getLogger(__name__)

IDLE_WAIT_S = 5.0
"""Longest sleep on the Condition with nothing queued: every change notifies it under its
lock, so this is only a safety net (and an idle worker's thread wakes rarely)."""


class ChunkSender:
    """Puts a stage's chunks under `stage_id`'s keys, from its own SAVE thread."""

    def __init__(
        self,
        transport: ChunkTransport,
        stage_id: int,
        metrics: Metrics,
        build_payload: Callable[[Any], Any] | None = None,
        snapshot: Callable[[Any], Any] = snapshot_tree,
    ) -> None:
        self.transport = transport
        self.stage_id = stage_id
        self.metrics = metrics
        self.build_payload: Callable[[Any], Any] = build_payload or (lambda snap: snap)
        self.snapshot = snapshot
        self._stop = threading.Event()
        self._lock = threading.RLock()
        """The book's lock (taken directly where nothing waits or is notified: a Condition's
        `with` is a Python call more)."""
        self._cv = threading.Condition(self._lock)
        self._book = SendBook()
        self.thread = threading.Thread(
            target=self._loop, name=f"chunk-save-{stage_id}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    # --- caller's side: in-memory only ------------------------------------------

    def save_async(self, request_id: str, obj: Any, is_final: bool) -> None:
        snap = self.snapshot(obj)
        with self._cv:
            self._book.save(request_id, snap, is_final)
            self._cv.notify()

    def cancel_sender(self, request_id: str) -> None:
        with self._lock:
            self._book.cancel(request_id, time.monotonic())

    def discard(self, request_id: str) -> None:
        with self._cv:
            self._book.discard(request_id, time.monotonic())
            self._cv.notify()

    def request_stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()

    # --- SAVE thread -------------------------------------------------------------

    def _loop(self) -> None:
        batch: list[Staged] = []
        while True:
            with self._cv:
                while not self._book.queue and not batch and not self._stop.is_set():
                    self._cv.wait(IDLE_WAIT_S)
                if self._stop.is_set():
                    return
                taken = self._book.take()
            if taken is not None:
                item, cancelled = taken
                if item.purge:
                    self._flush(batch)
                    batch = []
                    self._purge(item)
                    continue
                staged = self._build(item, cancelled)
                if staged is not None:
                    batch.append(staged)
            with self._lock:
                more = bool(self._book.queue)
            if batch and (not more or len(batch) >= self.transport.max_batch):
                self._flush(batch)
                batch = []

    def _build(self, item: SendItem, cancelled: bool) -> Staged | None:
        """Cancel check, then build outside the lock; None when nothing is to be put."""
        if cancelled and not item.is_final:
            self.metrics.inc("omni_chunks_dropped_total", stage=self.stage_id)
            self._skip(item)
            return None
        payload = None
        if not cancelled:
            built = foreign.call(self.build_payload, item.snapshot)
            if isinstance(built, Raised):  # user code: whatever it raises skips the chunk
                log.error(
                    "build_payload failed for %r; chunk skipped",
                    item.request_id,
                    exc_info=built.error,
                    extra={"request_id": item.request_id},
                )
            else:
                payload = built
        if payload is None and not item.is_final:
            self._skip(item)
            return None
        return Staged(item.request_id, {"data": payload, "finished": item.is_final})

    def _skip(self, item: SendItem) -> None:
        with self._lock:
            self._book.done(item)

    def _flush(self, batch: list[Staged]) -> None:
        """Put the batch; only a successful put advances ids. A chunk the transport rejects
        (cannot encode, too large) fails alone: dropped, or a final sent with data None."""
        while batch:
            with self._lock:
                self._book.number(batch)
            items = [
                (
                    keys.chunk_key(s.request_id, self.stage_id, s.chunk_id),
                    s.chunk,
                    s.chunk["finished"],
                )
                for s in batch
            ]
            put = foreign.call(self.transport.put_batch, items)  # a connector's code
            if isinstance(put, Raised) and isinstance(put.error, ChunkRejected):
                batch = self._reject(batch, items, put.error.rejected)
                continue
            if isinstance(put, Raised):  # the SAVE thread outlives any failed put: counted
                self.metrics.inc("omni_chunk_put_failures_total", len(batch), stage=self.stage_id)
                log.error(
                    "put of %d chunk(s) failed, dropped (%s ...): %r",
                    len(batch),
                    items[0][0],
                    put.error,
                )
                self._sent(batch, ok=False)
                return
            self.metrics.inc("omni_chunks_sent_total", len(batch), stage=self.stage_id)
            self._sent(batch, ok=True)
            return

    def _reject(
        self, batch: list[Staged], items: list[Any], rejected: dict[str, str]
    ) -> list[Staged]:
        keep: list[Staged] = []
        for staged, (key, _value, _last) in zip(batch, items, strict=True):
            if key not in rejected:
                keep.append(staged)
                continue
            self.metrics.inc("omni_chunks_dropped_total", stage=self.stage_id)
            log.error(
                "chunk %s cannot be put, dropped: %s",
                key,
                rejected[key],
                extra={"request_id": staged.request_id},
            )
            if staged.chunk["finished"]:
                if staged.chunk["data"] is None:  # even the bare final fails: give up on it
                    self._sent([staged], ok=False)
                    continue
                keep.append(Staged(staged.request_id, {"data": None, "finished": True}))
            else:
                with self._lock:
                    self._book.done(SendItem(staged.request_id, None, False))
        return keep

    def _sent(self, batch: list[Staged], ok: bool) -> None:
        with self._lock:
            self._book.sent(batch, ok)

    def _purge(self, item: SendItem) -> None:
        """Delete every chunk key this stage wrote for a discarded request."""
        with self._lock:
            upto = self._book.purge(item)
        if not upto:
            return
        discarded = foreign.call(  # a connector's code
            self.transport.discard,
            [keys.chunk_key(item.request_id, self.stage_id, i) for i in range(upto)],
        )
        if isinstance(discarded, Raised):  # best effort: the chunks expire anyway
            log.warning(
                "deleting the chunks of aborted %r failed (they expire): %r",
                item.request_id,
                discarded.error,
                extra={"request_id": item.request_id},
            )
