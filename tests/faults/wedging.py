"""A step engine that wedges its worker's scheduler loop on purpose, in one process only."""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any

from omni_runtime.stage_api import EngineOutput

WEDGE_AFTER_STEPS = "TEST_WEDGE_AFTER_STEPS"
"""Set to N in one worker's environment: its engine's step after the Nth never returns."""


class WedgingEngine:
    """Echoes each input upper-cased, one request per step; in a process whose environment
    has `WEDGE_AFTER_STEPS`, the step after that many blocks for good (`step()` runs on
    the scheduler loop's thread: the loop is wedged, the rest of the process goes on)."""

    def __init__(self) -> None:
        after = os.environ.get(WEDGE_AFTER_STEPS, "")
        self.wedge_after = int(after) if after.isdigit() else None
        self.steps = 0
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, Any]] = deque()

    def add_request(self, request_id: str, data: Any) -> None:
        with self._lock:
            self._queue.append((request_id, data))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._queue = deque(item for item in self._queue if item[0] != request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._queue)

    def step(self) -> list[EngineOutput]:
        if self.steps == self.wedge_after:
            threading.Event().wait()  # the fault: wedged for good
        with self._lock:
            if not self._queue:
                return []
            request_id, data = self._queue.popleft()
        self.steps += 1
        return [EngineOutput(request_id, [str(w).upper() for w in data], True)]
