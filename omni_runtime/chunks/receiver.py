"""The RECV half of the ChunkAdapter (SPEC §4): register on the caller, get + commit on one thread.

`load_async`, `poll_ready`, `cleanup_receiver` and `discard` only touch
in-memory structures under a lock and return at once. One RECV thread does all
getting. A per-registration token, compared under the same lock as the
commit, makes `cleanup_receiver` a barrier against a get that was in flight
when it ran.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from omni_runtime import keys
from omni_runtime.chunks.sender import Chunk
from omni_runtime.chunks.sweeper import ChunkSweeper, _KeysCall, _PeekMany
from omni_runtime.core.types import Connector, MalformedChunk

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1
"""Longest sleep on the Condition: a lost notification costs at most this much."""
NO_PROGRESS_SLEEP_S = 0.001
"""Pause between polling rounds that found nothing, for connectors with no wake-up signal."""
SWEEP_INTERVAL_S = 0.5
"""With wake-ups: how often parked requests are polled anyway (a safety net, not the path)."""
READ_AHEAD = 8
"""Ids looked at per round for a request that just made progress (drains a backlog fast)."""
MAX_GET_BACKOFF_S = 1.0

_Round = list[tuple[str, object, int]]
"""(request, token, next id) of each request polled in one round."""


def _is_chunk(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.keys() == {"data", "finished"}
        and isinstance(value["finished"], bool)
    )


class ChunkReceiver:
    """Gets a stage's chunks from `src_stage_id`'s keys, on its own RECV thread."""

    def __init__(
        self,
        connector: Connector,
        src_stage_id: int,
        on_ready: Callable[[], None] | None = None,
        *,
        thread_name: str | None = None,
    ) -> None:
        self.connector = connector
        self.src_stage_id = src_stage_id
        self.on_ready = on_ready
        """Called on the RECV thread after new chunks were committed: wakes a sleeping scheduler."""
        self._get_many: Callable[[Sequence[str]], list[Any]] | None = getattr(
            connector, "get_many", None
        )
        self._peek_many: _PeekMany | None = getattr(connector, "peek_many", None)
        self._delete_many: _KeysCall | None = getattr(connector, "delete_many", None)
        self._deletes_pending: Callable[[], bool] | None = getattr(
            connector, "deletes_pending", None
        )
        """A connector may hold back deletes it had no round trip for; flushed when idle."""
        self._listen: _KeysCall | None = getattr(connector, "listen", None)
        self._unlisten: _KeysCall | None = getattr(connector, "unlisten", None)
        on_put: Callable[[Callable[[str], None]], None] | None = getattr(connector, "on_put", None)
        self._has_wakeups = on_put is not None
        """With wake-ups, idle requests are parked instead of polled every round."""
        self._stop = threading.Event()
        # state guarded by _recv_cv
        self._recv_cv = threading.Condition()
        self._tokens: dict[str, object] = {}
        self._recv_ids: dict[str, int] = {}
        self._ready: dict[str, list[Chunk]] = {}
        self._poll_q: deque[str] = deque()
        self._to_listen: list[str] = []
        self._to_unlisten: list[str] = []
        self._parked: set[str] = set()
        """Registered requests that found nothing: polled again on a wake-up or a sweep."""
        self._notified: set[str] = set()
        """Woken while in flight: must not be parked by the commit of that same round."""
        self._last_sweep = time.monotonic()
        self._hot: set[str] = set()
        """Requests that made progress last round (RECV thread only): read ahead for them."""
        self._sweeper = ChunkSweeper(
            self._recv_cv, src_stage_id, self._peek_many, self._delete_many
        )
        """Unread chunks of discarded requests to delete: guarded by _recv_cv, run on RECV."""
        self._consumed: list[str] = []
        """Keys committed but not yet deleted (RECV thread only): go with the next read."""
        # counters, for logs and metrics
        self.received_chunks = 0
        self.failed_gets = 0
        self.malformed_chunks = 0
        if on_put is not None:
            on_put(self._on_put)
        name = thread_name or f"chunk-recv-from-{src_stage_id}"
        self.thread = threading.Thread(target=self._recv_loop, name=name, daemon=True)
        self.thread.start()

    # --- scheduler-thread API: in-memory only, returns at once ---------------

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
            self._parked.discard(request_id)
            self._notified.discard(request_id)
            self._recv_ids.pop(request_id, None)
            self._ready.pop(request_id, None)

    def discard(self, request_id: str) -> None:
        """Stop receiving the request and delete its unread chunks (now and once more
        `chunk_sweeper.LATE_SWEEP_S` later). Returns at once; the RECV thread does the I/O."""
        with self._recv_cv:
            self._sweeper.schedule(request_id, self._recv_ids.get(request_id, 0))
            self._recv_cv.notify()
        self.cleanup_receiver(request_id)

    def pending_receives(self) -> int:
        """How many requests are registered and still waiting for chunks."""
        with self._recv_cv:
            return len(self._tokens)

    def request_stop(self) -> None:
        """Signal the RECV thread to stop, without waiting for it."""
        self._stop.set()
        with self._recv_cv:
            self._recv_cv.notify_all()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Wake the RECV thread and join it; returns promptly even while it idles."""
        self.request_stop()
        self.thread.join(timeout_s)

    # --- RECV thread: get + commit only ---------------------------------------

    def _on_put(self, route_id: str) -> None:
        """A sender put a chunk of `<req>_<stage>`: poll that request in the next round."""
        rid, _, stage = route_id.rpartition("_")
        if stage != str(self.src_stage_id):
            return
        with self._recv_cv:
            if rid in self._parked:
                self._parked.discard(rid)
                self._poll_q.append(rid)
                self._recv_cv.notify()
            elif rid in self._tokens:
                self._notified.add(rid)

    def _recv_loop(self) -> None:
        backoff_s = 0.0
        while not self._stop.is_set():
            taken = self._take_round()
            if taken is None:
                return
            batch, to_listen, to_unlisten = taken
            try:
                self._update_routes(to_listen, to_unlisten)
                progress = self._poll(batch)
            except Exception as e:
                self.failed_gets += 1
                backoff_s = min(MAX_GET_BACKOFF_S, max(0.01, backoff_s * 2))
                log.warning("chunk get failed (retrying in %.2fs): %r", backoff_s, e)
                with self._recv_cv:
                    self._to_listen.extend(to_listen)
                    self._to_unlisten.extend(to_unlisten)
                self._commit(batch, [1] * len(batch), [None] * len(batch), requeue=True)
                self._stop.wait(backoff_s)
                continue
            backoff_s = 0.0
            if progress:
                if self.on_ready is not None:
                    self.on_ready()
                    time.sleep(0)  # let the woken scheduler take the GIL before the next round
            elif not self._has_wakeups:
                self._stop.wait(NO_PROGRESS_SLEEP_S)

    def _take_round(self) -> tuple[_Round, list[str], list[str]] | None:
        """Under the lock: the queued, still-registered requests with their token and next id.

        With nothing queued, first hand the deletions of consumed keys to Redis,
        then sleep on the Condition; every `SWEEP_INTERVAL_S` the parked
        requests are polled anyway, so a lost wake-up costs latency, never data.
        """
        pending = self._deletes_pending is not None and self._deletes_pending()
        if (self._consumed or pending) and self._delete_many is not None and not self._poll_q:
            consumed, self._consumed = self._consumed, []
            try:
                self._delete_many(consumed)
            except Exception as e:
                log.warning(
                    "deleting %d consumed chunk(s) failed (they expire): %r", len(consumed), e
                )
        self._sweeper.run_due()
        with self._recv_cv:
            while not self._poll_q and not self._to_unlisten and not self._stop.is_set():
                if self._parked and time.monotonic() - self._last_sweep >= SWEEP_INTERVAL_S:
                    break
                due = self._sweeper.next_due()
                if due is not None and due <= time.monotonic():
                    break
                self._recv_cv.wait(IDLE_WAIT_S)
            if self._stop.is_set():
                return None
            if time.monotonic() - self._last_sweep >= SWEEP_INTERVAL_S:
                self._last_sweep = time.monotonic()
                self._poll_q.extend(self._parked)
                self._parked.clear()
            batch: _Round = []
            seen: set[str] = set()
            while self._poll_q:
                rid = self._poll_q.popleft()
                token = self._tokens.get(rid)
                if token is None or rid in seen:
                    continue
                seen.add(rid)
                self._notified.discard(rid)
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

    def _poll(self, batch: _Round) -> bool:
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
            # last round's consumed keys are deleted in the same round trip, before the read
            consumed, self._consumed = self._consumed, []
            values = self._peek_many(round_keys, consumed)
            taken = self._commit(batch, depths, values, round_keys)
            self._consumed = taken
            return bool(taken)
        round_keys = [keys.chunk_key(rid, src, next_id) for rid, _t, next_id in batch]
        if self._get_many is not None:
            values = self._get_many(round_keys)
        else:
            values = [self.connector.get(k) for k in round_keys]
        return bool(self._commit(batch, [1] * len(batch), values, round_keys))

    def _commit(
        self,
        batch: _Round,
        depths: list[int],
        values: list[Any],
        round_keys: list[str] | None = None,
        requeue: bool = False,
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
                        log.error("malformed chunk %s skipped", key)  # the key of that id
                        continue
                    self.received_chunks += 1
                    self._ready.setdefault(rid, []).append(value)
                    if value["finished"]:
                        finished = True
                        break
                if finished:
                    del self._tokens[rid], self._recv_ids[rid]
                    self._to_unlisten.append(rid)
                    self._notified.discard(rid)
                    continue
                if took:
                    hot.add(rid)
                    self._recv_ids[rid] = next_id + took
                if took or requeue or not self._has_wakeups or rid in self._notified:
                    self._notified.discard(rid)
                    self._poll_q.append(rid)
                else:
                    self._parked.add(rid)
        self._hot = hot
        return taken_keys
