"""The ChunkAdapter's bookkeeping (SPEC §4) as plain code: no I/O, no threads, no locks.

`SendBook` is the SAVE half (`recv_book.RecvBook` the RECV half). The thread loops
in `omni_runtime.chunks` call them under their own lock and do the I/O in between,
so every rule that is not I/O is tested here without threads (times passed in).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

Chunk = dict[str, Any]
"""Exactly `{"data": payload, "finished": is_final}`."""

CANCEL_MARK_TTL_S = 600.0
"""A cancel mark of a request that never sends its final is forgotten after this long."""


@dataclass(slots=True)
class SendItem:
    """One `save_async` (or a discard's purge) waiting in the SAVE FIFO."""

    request_id: str
    snapshot: Any
    is_final: bool
    purge: bool = False


@dataclass(slots=True)
class Staged:
    """A built chunk waiting for its put; `chunk_id` is set when the batch is numbered."""

    request_id: str
    chunk: Chunk
    chunk_id: int = 0


@dataclass(slots=True)
class _SendState:
    next_id: int = 0
    queued: int = 0
    finals_queued: int = 0
    purge_upto: int | None = None
    """Set while a purge is wanted: one past the last id put, known once the final went out."""


class SendBook:
    """Per-request SAVE state; the caller holds one lock around every call."""

    def __init__(self, cancel_mark_ttl_s: float = CANCEL_MARK_TTL_S) -> None:
        self.cancel_mark_ttl_s = cancel_mark_ttl_s
        self.queue: deque[SendItem] = deque()
        self._states: dict[str, _SendState] = {}
        self._marks: OrderedDict[str, float] = OrderedDict()
        """Cancelled requests, oldest mark first: bounded by age, final put and discard."""

    def save(self, request_id: str, snapshot: Any, is_final: bool) -> None:
        st = self._states.setdefault(request_id, _SendState())
        st.queued += 1
        st.finals_queued += is_final
        self.queue.append(SendItem(request_id, snapshot, is_final))

    def cancel(self, request_id: str, now: float) -> None:
        """Mark the request, saved or not yet: later non-finals drop, the final carries None."""
        self._marks.pop(request_id, None)
        self._marks[request_id] = now
        self.expire(now)

    def discard(self, request_id: str, now: float) -> None:
        """Mid-stream: cancel and queue a None final unless one is queued; then purge its keys."""
        st = self._states.setdefault(request_id, _SendState())
        if st.queued or st.next_id:
            self.cancel(request_id, now)
            if not st.finals_queued:
                self.save(request_id, None, True)
        else:
            self._marks.pop(request_id, None)
        st.purge_upto = st.purge_upto or 0
        st.queued += 1
        self.queue.append(SendItem(request_id, None, True, purge=True))

    def expire(self, now: float) -> None:
        """Forget cancel marks older than the age limit (a request that never sends a final)."""
        while self._marks and now - next(iter(self._marks.values())) >= self.cancel_mark_ttl_s:
            self._marks.popitem(last=False)

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self._marks

    def take(self) -> tuple[SendItem, bool] | None:
        """The next FIFO item and whether its request is cancelled (checked at its turn)."""
        item = self.queue.popleft() if self.queue else None
        return None if item is None else (item, item.request_id in self._marks)

    def done(self, item: SendItem) -> None:
        """A non-final item left without a put (dropped, skipped), or a purge that ran."""
        st = self._states.get(item.request_id)
        if st is not None:
            st.queued -= 1
            self._forget_if_idle(item.request_id, st)

    def number(self, batch: list[Staged]) -> None:
        """Give each staged chunk the next id of its request, in batch order (ids restart
        at 0 after a final); nothing is advanced until `sent`."""
        nxt: dict[str, int] = {}
        for staged in batch:
            rid = staged.request_id
            st = self._states.get(rid)
            staged.chunk_id = nxt.get(rid, st.next_id if st is not None else 0)
            nxt[rid] = 0 if staged.chunk["finished"] else staged.chunk_id + 1

    def sent(self, batch: list[Staged], ok: bool) -> None:
        """After the put of `batch`: only a successful put advances ids; a final ends the
        request's id counter and cancel mark either way."""
        for staged in batch:
            st = self._states[staged.request_id]  # queued by `save`, so it has state
            st.queued -= 1
            if ok:
                st.next_id = staged.chunk_id + 1
            if staged.chunk["finished"]:
                st.finals_queued -= 1
                if st.purge_upto is not None:
                    st.purge_upto = max(st.purge_upto, staged.chunk_id + ok)
                st.next_id = 0
                self._marks.pop(staged.request_id, None)
            self._forget_if_idle(staged.request_id, st)

    def purge(self, item: SendItem) -> int:
        """A purge's turn came: how many ids (0 .. n-1) of the request to delete."""
        st = self._states[item.request_id]  # queued by `discard`, so it has state
        upto = st.purge_upto or st.next_id
        st.purge_upto, st.next_id = None, 0
        self._marks.pop(item.request_id, None)
        self.done(item)
        return upto

    def _forget_if_idle(self, rid: str, st: _SendState) -> None:
        if not st.queued and not st.next_id and st.purge_upto is None:
            del self._states[rid]

    def tracked(self) -> int:
        """Requests with state (for tests: memory stays bounded)."""
        return len(self._states) + len(self._marks)
