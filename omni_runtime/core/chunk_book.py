"""The ChunkAdapter's bookkeeping (SPEC §4) as plain code: no I/O, no threads, no locks.

`SendBook` is the SAVE half, `RecvBook` the RECV half. The thread loops in
`omni_runtime.chunks` call them under their own lock and do the I/O in between,
so every rule that is not I/O is tested here without threads (times passed in).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

Chunk = dict[str, Any]
"""Exactly `{"data": payload, "finished": is_final}`."""

_KEYS = {"data", "finished"}
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
    return isinstance(value, dict) and value.keys() == _KEYS and type(value["finished"]) is bool


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

    def next_id(self, request_id: str) -> int:
        """The first id not read yet (0 when not registered)."""
        return self._next_ids.get(request_id, 0)

    def registered(self) -> int:
        return len(self._tokens)

    def has_parked(self) -> bool:
        return bool(self._parked)

    def busy(self) -> bool:
        """Something to do without waiting for a put."""
        return bool(self._queue or self.routes)

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
        """Commit, in id order, what belongs to a live registration (token `is` the one read):
        `depth` values per slot; `None` ends a row, a non-chunk is skipped, a final unregisters."""
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
