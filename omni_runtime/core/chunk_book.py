"""The ChunkAdapter's bookkeeping (SPEC §4) as plain code: no I/O, no threads, no locks.

`SendBook` is the SAVE half (the FIFO, per-request next id, cancel marks, finals
in flight, purges), `RecvBook` the RECV half (registration tokens, next ids,
ready chunks, the polling queue, parked and hot requests, sweeps). The thread
loops in `omni_runtime.chunks` call them under their own lock and do the I/O
in between; every rule of SPEC §4 that is not I/O lives here and is tested
without threads. Times are passed in (`now`), so ages are testable too.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
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
        st = self._states.get(request_id)
        if st is not None and (st.queued or st.next_id):
            self.cancel(request_id, now)
            if not st.finals_queued:
                self.save(request_id, None, True)
        else:
            self._marks.pop(request_id, None)
        st = self._states.setdefault(request_id, _SendState())
        st.purge_upto = st.purge_upto or 0
        st.queued += 1
        self.queue.append(SendItem(request_id, None, True, purge=True))

    def expire(self, now: float) -> None:
        """Forget cancel marks older than the age limit (a request that never sends a final)."""
        while self._marks:
            rid, at = next(iter(self._marks.items()))
            if now - at < self.cancel_mark_ttl_s:
                return
            del self._marks[rid]

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self._marks

    def take(self) -> tuple[SendItem, bool] | None:
        """The next FIFO item and whether its request is cancelled (checked at its turn)."""
        if not self.queue:
            return None
        item = self.queue.popleft()
        return item, item.request_id in self._marks

    def done(self, item: SendItem) -> None:
        """An item left without a put (dropped, skipped, or a purge that ran)."""
        st = self._states.get(item.request_id)
        if st is None:
            return
        st.queued -= 1
        if item.is_final and not item.purge:
            st.finals_queued -= 1
            self._final_done(item.request_id, st, st.next_id)
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
            st = self._states.get(staged.request_id)
            if st is None:
                continue
            st.queued -= 1
            if ok:
                st.next_id = staged.chunk_id + 1
            if staged.chunk["finished"]:
                st.finals_queued -= 1
                self._final_done(staged.request_id, st, staged.chunk_id + ok)
            self._forget_if_idle(staged.request_id, st)

    def purge(self, item: SendItem) -> int:
        """A purge's turn came: how many ids (0 .. n-1) of the request to delete."""
        st = self._states.get(item.request_id)
        upto = 0
        if st is not None:
            upto = st.purge_upto or st.next_id
            st.purge_upto = None
            st.next_id = 0
        self._marks.pop(item.request_id, None)
        self.done(item)
        return upto

    def _final_done(self, rid: str, st: _SendState, upto: int) -> None:
        if st.purge_upto is not None:
            st.purge_upto = max(st.purge_upto, upto)
        st.next_id = 0
        self._marks.pop(rid, None)

    def _forget_if_idle(self, rid: str, st: _SendState) -> None:
        if not st.queued and not st.next_id and st.purge_upto is None:
            del self._states[rid]

    def tracked(self) -> int:
        """Requests with state (for tests: memory stays bounded)."""
        return len(self._states) + len(self._marks)


# --- RECV ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Poll:
    """One request's slot in a round: read ids `next_id .. next_id + depth - 1`."""

    request_id: str
    token: object
    next_id: int
    depth: int


@dataclass(slots=True)
class Committed:
    """What one commit did: for counters and logs."""

    received: int = 0
    malformed: list[tuple[str, int]] = field(default_factory=list)
    """(request, chunk id) of every value skipped because it is not a chunk."""


def is_chunk(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.keys() == {"data", "finished"}
        and isinstance(value["finished"], bool)
    )


class RecvBook:
    """Per-request RECV state; the caller holds one lock around every call."""

    def __init__(self, read_ahead: int, parks: bool) -> None:
        self.read_ahead = read_ahead
        self.parks = parks
        """With put wake-ups, a request that found nothing is parked instead of polled again."""
        self._tokens: dict[str, object] = {}
        self._next_ids: dict[str, int] = {}
        self._ready: dict[str, list[Chunk]] = {}
        self._queue: deque[str] = deque()
        self._parked: set[str] = set()
        self._hot: set[str] = set()
        self.routes: dict[str, bool] = {}
        """Requests whose subscription must change: True subscribe, False unsubscribe."""
        self.sweeps: list[tuple[float, str, int]] = []
        """(due, request, first unread id): unread chunks of discarded requests to delete."""

    def register(self, request_id: str) -> bool:
        """`load_async`: a fresh token, next id 0, queued; False if already registered."""
        if request_id in self._tokens:
            return False
        self._tokens[request_id] = object()
        self._next_ids[request_id] = 0
        self._queue.append(request_id)
        self.routes[request_id] = True
        return True

    def take_ready(self) -> dict[str, list[Chunk]]:
        ready, self._ready = self._ready, {}
        return ready

    def cleanup(self, request_id: str) -> None:
        """The commit barrier: a round read before this no longer matches any token."""
        if self._tokens.pop(request_id, None) is not None:
            self.routes[request_id] = False
        self._next_ids.pop(request_id, None)
        self._ready.pop(request_id, None)
        self._parked.discard(request_id)

    def discard(self, request_id: str, now: float, late_s: float) -> None:
        """Sweep its unread chunks now and once more `late_s` later; then clean up."""
        first = self._next_ids.get(request_id, 0)
        self.sweeps += [(now, request_id, first), (now + late_s, request_id, first)]
        self.cleanup(request_id)

    def registered(self) -> int:
        return len(self._tokens)

    def has_parked(self) -> bool:
        return bool(self._parked)

    def busy(self, now: float) -> bool:
        """Something to do without waiting for a put."""
        return bool(self._queue or self.routes or self.due_sweeps(now, False))

    def due_sweeps(self, now: float, take: bool = True) -> list[tuple[str, int]]:
        due = [(rid, first) for at, rid, first in self.sweeps if at <= now]
        if take and due:
            self.sweeps = [sw for sw in self.sweeps if sw[0] > now]
        return due

    def next_sweep(self) -> float | None:
        return min((at for at, _r, _f in self.sweeps), default=None)

    def woken(self, request_ids: set[str]) -> None:
        """A put for these requests was reported: poll the parked ones again."""
        for rid in request_ids & self._parked:
            self._parked.discard(rid)
            self._queue.append(rid)

    def unpark_all(self) -> None:
        """The safety net: a lost wake-up costs latency, never data."""
        self._queue.extend(self._parked)
        self._parked.clear()

    def take_round(self) -> list[Poll]:
        """Every queued, still-registered request once, with its token and next id."""
        batch: list[Poll] = []
        seen: set[str] = set()
        while self._queue:
            rid = self._queue.popleft()
            token = self._tokens.get(rid)
            if token is None or rid in seen:
                continue
            seen.add(rid)
            depth = self.read_ahead if rid in self._hot else 1
            batch.append(Poll(rid, token, self._next_ids[rid], depth))
        return batch

    def requeue(self, batch: list[Poll]) -> None:
        """A failed read: poll the same requests again."""
        self._queue.extend(p.request_id for p in batch)

    def commit(self, batch: list[Poll], values: list[Any]) -> Committed:
        """Commit, in id order, what belongs to a live registration (token `is` the one read).

        `values` holds `depth` values per slot; `None` ends a slot's row, a value
        that is not a chunk is skipped (its id counts as read), a finished chunk
        unregisters the request.
        """
        out = Committed()
        hot: set[str] = set()
        i = 0
        for poll in batch:
            row = values[i : i + poll.depth]
            i += poll.depth
            rid = poll.request_id
            if self._tokens.get(rid) is not poll.token:
                continue  # cleaned up (and maybe registered again) meanwhile
            took, finished = 0, False
            for value in row:
                if value is None:
                    break
                took += 1
                if not is_chunk(value):
                    out.malformed.append((rid, poll.next_id + took - 1))
                    continue
                out.received += 1
                self._ready.setdefault(rid, []).append(value)
                if value["finished"]:
                    finished = True
                    break
            if finished:
                del self._tokens[rid], self._next_ids[rid]
                self.routes[rid] = False
                continue
            if took:
                hot.add(rid)
                self._next_ids[rid] = poll.next_id + took
            if took or not self.parks:
                self._queue.append(rid)
            else:
                self._parked.add(rid)
        self._hot = hot
        return out

    def take_routes(self) -> dict[str, bool]:
        """The subscription changes to make (the last one per request wins)."""
        routes, self.routes = self.routes, {}
        return routes

    def retry_routes(self, routes: dict[str, bool]) -> None:
        """They failed: make them again, unless changed meanwhile."""
        self.routes = {**routes, **self.routes}
