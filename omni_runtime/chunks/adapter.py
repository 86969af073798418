"""Streams a stage's partial results to the next stage, chunk by chunk (SPEC §4).

The stage's scheduler thread only ever touches in-memory structures under a
lock: `save_async`, `cancel_sender`, `load_async`, `poll_ready` and
`cleanup_receiver` return at once. One SAVE thread (`sender.ChunkSender`) does
all building and putting, one RECV thread (`receiver.ChunkReceiver`) all
reading; their bookkeeping is `core.chunk_book`. Whether the adapter was given
a SPEC connector or a full `ChunkTransport` is decided once, here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_runtime.chunks.receiver import ChunkReceiver
from omni_runtime.chunks.sender import ChunkSender
from omni_runtime.chunks.snapshot import snapshot as snapshot_tree
from omni_runtime.chunks.transport import ChunkTransport, Connector, PollingTransport
from omni_runtime.core.chunk_book import Chunk
from omni_runtime.observe.metrics import Metrics

__all__ = ["Chunk", "ChunkAdapter"]


class ChunkAdapter:
    """Sender (to `stage_id`'s keys) and receiver (from `src_stage_id`'s keys) of one stage.

    `connector` is a `ChunkTransport` (used as is) or any SPEC connector (lifted
    with `PollingTransport`). Counters go to `metrics` (a private registry if None).
    Its SAVE and RECV threads run once it is built (SPEC §4: the constructor is its start).
    """

    def __init__(
        self,
        connector: Connector | ChunkTransport,
        stage_id: int,
        src_stage_id: int | None = None,
        build_payload: Callable[[Any], Any] | None = None,
        snapshot: Callable[[Any], Any] = snapshot_tree,
        on_ready: Callable[[], None] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.connector = connector
        self.transport: ChunkTransport = (
            connector if isinstance(connector, ChunkTransport) else PollingTransport(connector)
        )
        self.stage_id = stage_id
        self.src_stage_id = stage_id - 1 if src_stage_id is None else src_stage_id
        self.metrics = metrics if metrics is not None else Metrics()
        self._sender = ChunkSender(self.transport, stage_id, self.metrics, build_payload, snapshot)
        self._receiver = ChunkReceiver(
            self.transport,
            self.src_stage_id,
            self.metrics,
            on_ready,
            stage_id=stage_id,
        )
        self._sender.start()  # SPEC §4 fixes the constructor as the start (test_layout)
        self._receiver.start()

    # --- scheduler-thread API: in-memory only, returns at once ---------------

    def save_async(self, request_id: str, obj: Any, is_final: bool) -> None:
        """Snapshot `obj` now (later mutation must not leak) and queue it for the SAVE thread."""
        self._sender.save_async(request_id, obj, is_final)

    def cancel_sender(self, request_id: str) -> None:
        """Mark the request (saved yet or not): later non-finals drop, the final carries None."""
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
        for thread in (self._sender.thread, self._receiver.thread):
            if thread.ident is not None:  # started
                thread.join(timeout_s)

    def pending_receives(self) -> int:
        """How many requests are registered and still waiting for chunks."""
        return self._receiver.pending_receives()

    def is_alive(self) -> bool:
        """Whether either thread still runs (after `stop`: neither)."""
        return self._sender.thread.is_alive() or self._receiver.thread.is_alive()
