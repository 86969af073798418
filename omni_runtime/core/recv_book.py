"""The RECV half of the ChunkAdapter's bookkeeping (SPEC §4): no I/O, no threads, no locks.

Which requests to read this round, how many ids of each, and what a read commits.
With a transport that reports puts, a request is read only when there is reason to:
just registered, or a put of an id it has not read yet was reported (then exactly
the ids reported, no read-ahead past them), or its backlog is being drained (a full
row read ahead again), or the sweep after a lost report. So a chunk whose value came
with its report costs no read at all.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.core.chunk_book import Chunk

_KEYS = {"data", "finished"}
MAX_DEPTH = 64
"""Most ids read for one request in one round."""


@dataclass(slots=True)
class Poll:
    """One request's slot in a round: read ids `next_id .. next_id + depth - 1`."""

    request_id: str
    token: object
    next_id: int
    depth: int
    reported: bool = False
    """The depth is what puts reported: a full row ends there, it is no backlog."""


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
        """With put reports, a request with nothing to read is parked instead of polled."""
        self._tokens: dict[str, object] = {}
        self._next_ids: dict[str, int] = {}
        self._ready: dict[str, list[Chunk]] = {}
        self._queue: deque[str] = deque()
        self._parked: set[str] = set()
        self._hot: set[str] = set()
        self._reported: dict[str, int] = {}
        """The highest chunk id whose put was reported, per registered request."""
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
        self._forget(request_id)
        self._ready.pop(request_id, None)

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

    def woken(self, reported: dict[str, int]) -> None:
        """Puts were reported (request → highest chunk id): read the ids not read yet."""
        for rid, upto in reported.items():
            nxt = self._next_ids.get(rid)
            if nxt is None:
                continue
            self._reported[rid] = max(upto, self._reported.get(rid, -1))
            if rid in self._parked and upto >= nxt:
                self._parked.discard(rid)
                self._queue.append(rid)

    def unpark_all(self) -> None:
        """The safety net: a lost report costs latency, never data (read as a backlog)."""
        for rid in self._parked:
            self._reported.pop(rid, None)
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
            nxt = self._next_ids[rid]
            ahead = self._reported.get(rid, -1) - nxt + 1
            if rid in self._hot or ahead <= 0:
                depth = self.read_ahead if rid in self._hot else 1
                batch.append(Poll(rid, token, nxt, depth))
            else:
                batch.append(Poll(rid, token, nxt, min(ahead, MAX_DEPTH), reported=True))
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
                del self._tokens[rid]
                self._forget(rid)
                self.routes[rid] = False
                continue
            nxt = self._next_ids[rid] = poll.next_id + took
            if not self.parks:  # no reports: poll on, reading ahead after progress
                if took:
                    hot.add(rid)
                self._queue.append(rid)
            elif took and self._reported.get(rid, -1) >= nxt:
                self._queue.append(rid)  # more was reported meanwhile
            elif took == poll.depth and not poll.reported:
                hot.add(rid)  # a full row of backlog: there may be more
                self._queue.append(rid)
            else:  # read up to the end, or all that was reported: the next report wakes it
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

    def _forget(self, rid: str) -> None:
        self._next_ids.pop(rid, None)
        self._reported.pop(rid, None)
        self._parked.discard(rid)
