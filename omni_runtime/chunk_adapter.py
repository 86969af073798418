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
READ_AHEAD = 8
"""Ids looked at per round for a request that just made progress (drains a backlog fast)."""
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
        self._peek_many: Callable[[Sequence[str]], list[Any]] | None = getattr(
            connector, "peek_many", None
        )
        self._delete_many: Callable[[Sequence[str]], None] | None = getattr(
            connector, "delete_many", None
        )
        self._listen: Callable[[Sequence[str]], None] | None = getattr(connector, "listen", None)
        self._unlisten: Callable[[Sequence[str]], None] | None = getattr(
            connector, "unlisten", None
        )
        self._recv_wake = threading.Event()
        """Set by the connector after a put (if it can tell) and by `load_async`."""
        on_put: Callable[[Callable[[], None]], None] | None = getattr(connector, "on_put", None)
        self._has_wakeups = on_put is not None
        if on_put is not None:
            on_put(self._recv_wake.set)
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
        self._to_listen: list[str] = []
        self._to_unlisten: list[str] = []
        self._hot: set[str] = set()
        """Requests that made progress last round (RECV thread only): read ahead for them."""
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
            self._to_listen.append(request_id)
            self._recv_cv.notify()
        self._recv_wake.set()

    def poll_ready(self) -> dict[str, list[Chunk]]:
        """Take everything received since the last call: `{req: [chunk, ...]}` in id order."""
        with self._recv_cv:
            ready, self._ready = self._ready, {}
        return ready

    def cleanup_receiver(self, request_id: str) -> None:
        """Commit barrier: once this returns, no get in flight for the request is committed."""
        with self._recv_cv:
            if self._tokens.pop(request_id, None) is not None:
                self._to_unlisten.append(request_id)
            self._recv_ids.pop(request_id, None)
            self._ready.pop(request_id, None)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Wake both threads and join them; returns promptly even while they idle."""
        self._stop.set()
        self._recv_wake.set()
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
            taken = self._take_round()
            if taken is None:
                return
            batch, to_listen, to_unlisten = taken
            self._recv_wake.clear()  # a put after this point wakes the idle wait below
            try:
                self._update_routes(to_listen, to_unlisten)
                progress = self._poll(batch)
            except Exception as e:
                self.failed_gets += 1
                backoff_s = min(MAX_GET_BACKOFF_S, max(0.01, backoff_s * 2))
                log.warning("chunk get failed (retrying in %.2fs): %r", backoff_s, e)
                with self._recv_cv:
                    self._to_listen.extend(to_listen)
                self._commit(batch, [1] * len(batch), [None] * len(batch))
                self._stop.wait(backoff_s)
                continue
            backoff_s = 0.0
            if progress:
                if self.on_ready is not None:
                    self.on_ready()
            elif self._has_wakeups:
                self._recv_wake.wait(IDLE_WAIT_S)
            else:
                self._stop.wait(NO_PROGRESS_SLEEP_S)

    def _take_round(self) -> tuple[list[tuple[str, object, int]], list[str], list[str]] | None:
        """Under the lock: the queued, still-registered requests with their token and next id."""
        with self._recv_cv:
            while not self._poll_q and not self._to_unlisten and not self._stop.is_set():
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
            to_listen, self._to_listen = self._to_listen, []
            to_unlisten, self._to_unlisten = self._to_unlisten, []
            return batch, to_listen, to_unlisten

    def _update_routes(self, to_listen: list[str], to_unlisten: list[str]) -> None:
        """Tell the connector whose puts should wake us, before the first poll of a request."""
        src = self.src_stage_id
        if self._listen is not None and to_listen:
            self._listen([f"{rid}_{src}" for rid in to_listen])
        if self._unlisten is not None and to_unlisten:
            self._unlisten([f"{rid}_{src}" for rid in to_unlisten])

    def _poll(self, batch: list[tuple[str, object, int]]) -> bool:
        """Outside the lock: fetch, then commit. Look ahead for requests that just made progress."""
        if not batch:
            return False
        src = self.src_stage_id
        if self._peek_many is not None and self._delete_many is not None:
            depths = [READ_AHEAD if rid in self._hot else 1 for rid, _t, _i in batch]
            round_keys = [
                keys.chunk_key(rid, src, next_id + j)
                for (rid, _t, next_id), depth in zip(batch, depths, strict=True)
                for j in range(depth)
            ]
            consumed = self._commit(batch, depths, self._peek_many(round_keys), round_keys)
            if consumed:
                self._delete_many(consumed)
            return bool(consumed)
        round_keys = [keys.chunk_key(rid, src, next_id) for rid, _t, next_id in batch]
        if self._get_many is not None:
            values = self._get_many(round_keys)
        else:
            values = [self.connector.get(k) for k in round_keys]
        return bool(self._commit(batch, [1] * len(batch), values, round_keys))

    def _commit(
        self,
        batch: list[tuple[str, object, int]],
        depths: list[int],
        values: list[Any],
        round_keys: list[str] | None = None,
    ) -> list[str]:
        """Under the lock: commit, in id order, what belongs to a live registration.

        Returns the keys taken (committed or skipped as malformed): the caller
        deletes them when it only peeked.
        """
        taken_keys: list[str] = []
        hot: set[str] = set()
        with self._recv_cv:
            i = 0
            for (rid, token, next_id), depth in zip(batch, depths, strict=True):
                row = values[i : i + depth]
                row_keys = round_keys[i : i + depth] if round_keys else [""] * depth
                i += depth
                if self._tokens.get(rid) is not token:
                    continue  # cleaned up (and maybe registered again) meanwhile
                took, finished = 0, False
                for value, key in zip(row, row_keys, strict=True):
                    if value is None:
                        break
                    took += 1
                    taken_keys.append(key)
                    if isinstance(value, MalformedChunk) or not _is_chunk(value):
                        self.malformed_chunks += 1
                        log.error(
                            "malformed chunk %s_%d_%d skipped",
                            rid,
                            self.src_stage_id,
                            next_id + took - 1,
                        )
                        continue
                    self.received_chunks += 1
                    self._ready.setdefault(rid, []).append(value)
                    if value["finished"]:
                        finished = True
                        break
                if finished:
                    del self._tokens[rid], self._recv_ids[rid]
                    self._to_unlisten.append(rid)
                    continue
                if took:
                    hot.add(rid)
                    self._recv_ids[rid] = next_id + took
                self._poll_q.append(rid)
        self._hot = hot
        return taken_keys
