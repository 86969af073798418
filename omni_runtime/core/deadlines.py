"""Per-request deadlines on one heap, for the orchestrator's deadline task (pure, no I/O).

Cancelling is lazy (a heap cannot remove from the middle cheaply): an entry is live
while it is the request's latest; dead entries are skipped, and dropped in bulk once
they outnumber the live ones, so memory follows live requests only.
"""

from __future__ import annotations

import heapq

COMPACT_SLACK = 64
"""Dead entries tolerated beyond the live ones before the heap is rebuilt."""


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        """(when, seq, request id); live while `_live[request id] == seq`."""
        self._live: dict[str, int] = {}
        self._seq = 0

    def __len__(self) -> int:
        """Entries held, dead ones included (what memory follows)."""
        return len(self._heap)

    def add(self, request_id: str, at: float) -> None:
        self._seq += 1
        self._live[request_id] = self._seq
        heapq.heappush(self._heap, (at, self._seq, request_id))

    def cancel(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is None:
            return
        if len(self._heap) > 2 * (len(self._live) + COMPACT_SLACK):
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def next_at(self) -> float | None:
        """When the earliest live deadline falls, None if there is none."""
        while self._heap and self._live.get(self._heap[0][2]) != self._heap[0][1]:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> str | None:
        """The request whose deadline passed first (no longer tracked), or None."""
        at = self.next_at()
        if at is None or at > now:
            return None
        _at, _seq, request_id = heapq.heappop(self._heap)
        del self._live[request_id]
        return request_id
