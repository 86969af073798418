"""Streams a stage's partial results to the next stage, chunk by chunk (SPEC §4).

The stage's scheduler thread only ever touches in-memory structures under a
lock: `save_async`, `cancel_sender`, `load_async`, `poll_ready` and
`cleanup_receiver` return at once. One SAVE thread does all building and
putting (one FIFO keeps each request's chunks ordered and ids contiguous);
one RECV thread does all getting. A per-registration token, compared under
the same lock as the commit, makes `cleanup_receiver` a barrier against a get
that was in flight when it ran.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from omni_runtime import keys
from omni_runtime.types import Connector, MalformedChunk

log = logging.getLogger(__name__)

Chunk = dict[str, Any]
"""Exactly `{"data": payload, "finished": is_final}`."""

IDLE_WAIT_S = 0.1
"""Longest sleep on a Condition: a lost notification costs at most this much."""
NO_PROGRESS_SLEEP_S = 0.001
"""Pause between polling rounds that found nothing, for connectors with no wake-up signal."""
MAX_GET_BACKOFF_S = 1.0


def _is_chunk(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.keys() == {"data", "finished"}
        and isinstance(value["finished"], bool)
    )


class ChunkAdapter:
    """Sender (to `stage_id`'s keys) and receiver (from `src_stage_id`'s keys) of one stage."""

    def __init__(
        self,
        connector: Connector,
        stage_id: int,
        src_stage_id: int | None = None,
        build_payload: Callable[[Any], Any] | None = None,
        snapshot: Callable[[Any], Any] = copy.deepcopy,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.connector = connector
        self.stage_id = stage_id
        self.src_stage_id = stage_id - 1 if src_stage_id is None else src_stage_id
        self.build_payload: Callable[[Any], Any] = build_payload or (lambda snap: snap)
        self.snapshot = snapshot
        self.on_ready = on_ready
        """Called on the RECV thread after new chunks were committed: wakes a sleeping scheduler."""
        self._get_many: Callable[[Sequence[str]], list[Any]] | None = getattr(
            connector, "get_many", None
        )
        self._wait_for_puts: Callable[[Sequence[str], float], bool] | None = getattr(
            connector, "wait_for_puts", None
        )
        self._stop = threading.Event()
        # sender state, guarded by _send_cv
        self._send_cv = threading.Condition()
        self._send_q: deque[tuple[str, Any, bool]] = deque()
        self._send_ids: dict[str, int] = {}
        self._send_pending: dict[str, int] = {}
        self._cancelled: set[str] = set()
        # receiver state, guarded by _recv_cv
        self._recv_cv = threading.Condition()
        self._tokens: dict[str, object] = {}
        self._recv_ids: dict[str, int] = {}
        self._ready: dict[str, list[Chunk]] = {}
        self._poll_q: deque[str] = deque()
        # counters, for logs and metrics
        self.sent_chunks = 0
        self.dropped_chunks = 0
        self.failed_puts = 0
        self.received_chunks = 0
        self.failed_gets = 0
        self.malformed_chunks = 0
        self._save_thread = threading.Thread(
            target=self._save_loop, name=f"chunk-save-{stage_id}", daemon=True
        )
        self._recv_thread = threading.Thread(
            target=self._recv_loop, name=f"chunk-recv-{stage_id}", daemon=True
        )
        self._save_thread.start()
        self._recv_thread.start()

    # --- scheduler-thread API: in-memory only, returns at once ---------------

    def save_async(self, request_id: str, obj: Any, is_final: bool) -> None:
        """Snapshot `obj` now (later mutation must not leak) and queue it for the SAVE thread."""
        snap = self.snapshot(obj)
        with self._send_cv:
            self._send_q.append((request_id, snap, is_final))
            self._send_pending[request_id] = self._send_pending.get(request_id, 0) + 1
            self._send_cv.notify()

    def cancel_sender(self, request_id: str) -> None:
        """Drop the request's queued non-final chunks; its final still goes out with data None."""
        with self._send_cv:
            if request_id in self._send_pending or request_id in self._send_ids:
                self._cancelled.add(request_id)

    def load_async(self, request_id: str) -> None:
        """Start receiving the request's chunks; a no-op while it is registered."""
        with self._recv_cv:
            if request_id in self._tokens:
                return
            self._tokens[request_id] = object()
            self._recv_ids[request_id] = 0
            self._poll_q.append(request_id)
            self._recv_cv.notify()

    def poll_ready(self) -> dict[str, list[Chunk]]:
        """Take everything received since the last call: `{req: [chunk, ...]}` in id order."""
        with self._recv_cv:
            ready, self._ready = self._ready, {}
        return ready

    def cleanup_receiver(self, request_id: str) -> None:
        """Commit barrier: once this returns, no get in flight for the request is committed."""
        with self._recv_cv:
            self._tokens.pop(request_id, None)
            self._recv_ids.pop(request_id, None)
            self._ready.pop(request_id, None)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Wake both threads and join them; returns promptly even while they idle."""
        self._stop.set()
        for cv in (self._send_cv, self._recv_cv):
            with cv:
                cv.notify_all()
        self._save_thread.join(timeout_s)
        self._recv_thread.join(timeout_s)

    def pending_receives(self) -> int:
        """How many requests are registered and still waiting for chunks."""
        with self._recv_cv:
            return len(self._tokens)

    # --- SAVE thread: build + put only ----------------------------------------

    def _save_loop(self) -> None:
        while True:
            with self._send_cv:
                while not self._send_q and not self._stop.is_set():
                    self._send_cv.wait(IDLE_WAIT_S)
                if self._stop.is_set():
                    return
                request_id, snap, is_final = self._send_q.popleft()
                cancelled = request_id in self._cancelled
            self._save_one(request_id, snap, is_final, cancelled)

    def _save_one(self, request_id: str, snap: Any, is_final: bool, cancelled: bool) -> None:
        try:
            if cancelled and not is_final:
                self.dropped_chunks += 1
                return
            payload = None if cancelled else self._build(request_id, snap)
            if payload is None and not is_final:
                return
            with self._send_cv:
                chunk_id = self._send_ids.get(request_id, 0)
            key = keys.chunk_key(request_id, self.stage_id, chunk_id)
            try:
                self.connector.put(key, {"data": payload, "finished": is_final})
            except Exception as e:
                self.failed_puts += 1
                log.error("put %s failed, chunk dropped (final=%s): %r", key, is_final, e)
                if is_final:
                    self._forget_sender(request_id)
                return
            self.sent_chunks += 1
            with self._send_cv:
                self._send_ids[request_id] = chunk_id + 1
            if is_final:
                self._forget_sender(request_id)
        finally:
            with self._send_cv:
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

    def _forget_sender(self, request_id: str) -> None:
        with self._send_cv:
            self._send_ids.pop(request_id, None)
            self._cancelled.discard(request_id)

    # --- RECV thread: get + commit only ---------------------------------------

    def _recv_loop(self) -> None:
        backoff_s = 0.0
        while not self._stop.is_set():
            batch = self._take_round()
            if batch is None:
                return
            if not batch:
                continue
            round_keys = [keys.chunk_key(r, self.src_stage_id, i) for r, _t, i in batch]
            try:
                values = self._fetch(round_keys)
            except Exception as e:
                self.failed_gets += 1
                backoff_s = min(MAX_GET_BACKOFF_S, max(0.01, backoff_s * 2))
                log.warning("chunk get failed (retrying in %.2fs): %r", backoff_s, e)
                self._commit(batch, [None] * len(batch))
                self._stop.wait(backoff_s)
                continue
            backoff_s = 0.0
            if self._commit(batch, values):
                if self.on_ready is not None:
                    self.on_ready()
            else:
                self._idle_between_rounds(round_keys)

    def _take_round(self) -> list[tuple[str, object, int]] | None:
        """Under the lock: the queued, still-registered requests with their token and next id."""
        with self._recv_cv:
            while not self._poll_q and not self._stop.is_set():
                self._recv_cv.wait(IDLE_WAIT_S)
            if self._stop.is_set():
                return None
            batch: list[tuple[str, object, int]] = []
            seen: set[str] = set()
            while self._poll_q:
                rid = self._poll_q.popleft()
                token = self._tokens.get(rid)
                if token is None or rid in seen:
                    continue
                seen.add(rid)
                batch.append((rid, token, self._recv_ids[rid]))
            return batch

    def _fetch(self, round_keys: list[str]) -> list[Any]:
        """Outside the lock: one batched round trip when the connector offers one."""
        if self._get_many is not None:
            return self._get_many(round_keys)
        return [self.connector.get(k) for k in round_keys]

    def _commit(self, batch: list[tuple[str, object, int]], values: list[Any]) -> bool:
        """Under the lock: commit what belongs to a live registration; True if anything did."""
        progress = False
        with self._recv_cv:
            for (rid, token, chunk_id), value in zip(batch, values, strict=True):
                if self._tokens.get(rid) is not token:
                    continue  # cleaned up (and maybe registered again) meanwhile
                if value is None:
                    self._poll_q.append(rid)
                    continue
                progress = True
                self._recv_ids[rid] = chunk_id + 1
                if isinstance(value, MalformedChunk) or not _is_chunk(value):
                    self.malformed_chunks += 1
                    log.error("malformed chunk %s_%d_%d skipped", rid, self.src_stage_id, chunk_id)
                    self._poll_q.append(rid)
                    continue
                self.received_chunks += 1
                self._ready.setdefault(rid, []).append(value)
                if value["finished"]:
                    del self._tokens[rid], self._recv_ids[rid]
                else:
                    self._poll_q.append(rid)
        return progress

    def _idle_between_rounds(self, round_keys: list[str]) -> None:
        """Nothing arrived: block on the connector's put signal if it has one, else ~1 ms."""
        if self._wait_for_puts is not None:
            try:
                self._wait_for_puts(round_keys, IDLE_WAIT_S)
                return
            except Exception as e:
                log.warning("wait_for_puts failed, polling instead: %r", e)
        self._stop.wait(NO_PROGRESS_SLEEP_S)
