"""Streams a stage's partial results to the next stage, chunk by chunk (SPEC §4).

The stage's scheduler thread only ever touches in-memory structures under a
lock: `save_async`, `cancel_sender`, `load_async`, `poll_ready` and
`cleanup_receiver` return at once. One SAVE thread does all building and
putting (one FIFO keeps each request's chunks ordered and ids contiguous);
one RECV thread does all getting. A per-registration token, compared under
the same lock as the commit, makes `cleanup_receiver` a barrier against a get
that was in flight when it ran.

The two halves live in `chunk_sender.ChunkSender` (SAVE) and
`chunk_receiver.ChunkReceiver` (RECV); this class is the one stage-facing
object that owns both.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from omni_runtime.chunks.receiver import ChunkReceiver
from omni_runtime.chunks.sender import Chunk, ChunkSender
from omni_runtime.core.types import Connector

__all__ = ["Chunk", "ChunkAdapter"]


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
        self._sender = ChunkSender(connector, stage_id, build_payload, snapshot)
        self._receiver = ChunkReceiver(
            connector, self.src_stage_id, on_ready, thread_name=f"chunk-recv-{stage_id}"
        )
        self._save_thread = self._sender.thread
        self._recv_thread = self._receiver.thread

    # --- scheduler-thread API: in-memory only, returns at once ---------------

    def save_async(self, request_id: str, obj: Any, is_final: bool) -> None:
        """Snapshot `obj` now (later mutation must not leak) and queue it for the SAVE thread."""
        self._sender.save_async(request_id, obj, is_final)

    def cancel_sender(self, request_id: str) -> None:
        """Drop the request's queued non-final chunks; its final still goes out with data None."""
        self._sender.cancel_sender(request_id)

    def load_async(self, request_id: str) -> None:
        """Start receiving the request's chunks; a no-op while it is registered."""
        self._receiver.load_async(request_id)

    def poll_ready(self) -> dict[str, list[Chunk]]:
        """Take everything received since the last call: `{req: [chunk, ...]}` in id order."""
        return self._receiver.poll_ready()

    def cleanup_receiver(self, request_id: str) -> None:
        """Commit barrier: once this returns, no get in flight for the request is committed."""
        self._receiver.cleanup_receiver(request_id)

    def discard(self, request_id: str) -> None:
        """Abort the request here: drop its queued chunks (a final with data None still goes
        out if it was mid-stream), stop receiving it, and delete every chunk key of it that
        this stage wrote or had yet to read. Returns at once; the threads do the I/O."""
        self._sender.discard(request_id)
        self._receiver.discard(request_id)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Wake both threads and join them; returns promptly even while they idle."""
        self._sender.request_stop()
        self._receiver.request_stop()
        self._save_thread.join(timeout_s)
        self._recv_thread.join(timeout_s)

    def pending_receives(self) -> int:
        """How many requests are registered and still waiting for chunks."""
        return self._receiver.pending_receives()

    # --- the halves' callables, readable and settable here as before ---------------

    @property
    def build_payload(self) -> Callable[[Any], Any]:
        """`build_payload(snapshot) -> payload | None`, called on the SAVE thread."""
        return self._sender.build_payload

    @build_payload.setter
    def build_payload(self, fn: Callable[[Any], Any]) -> None:
        self._sender.build_payload = fn

    @property
    def snapshot(self) -> Callable[[Any], Any]:
        """Copies `obj` in `save_async`, on the caller's thread."""
        return self._sender.snapshot

    @snapshot.setter
    def snapshot(self, fn: Callable[[Any], Any]) -> None:
        self._sender.snapshot = fn

    @property
    def on_ready(self) -> Callable[[], None] | None:
        """Called on the RECV thread after new chunks were committed: wakes a sleeping scheduler."""
        return self._receiver.on_ready

    @on_ready.setter
    def on_ready(self, fn: Callable[[], None] | None) -> None:
        self._receiver.on_ready = fn

    # --- counters, for logs and metrics (read-only) -----------------------------

    @property
    def sent_chunks(self) -> int:
        return self._sender.sent_chunks

    @property
    def dropped_chunks(self) -> int:
        return self._sender.dropped_chunks

    @property
    def failed_puts(self) -> int:
        return self._sender.failed_puts

    @property
    def received_chunks(self) -> int:
        return self._receiver.received_chunks

    @property
    def failed_gets(self) -> int:
        return self._receiver.failed_gets

    @property
    def malformed_chunks(self) -> int:
        return self._receiver.malformed_chunks
