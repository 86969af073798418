"""A step engine that fails on purpose: on inputs that ask for it, or on every input."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from omni_runtime.stage_api import EngineOutput, StepFailed


class PoisonEngine:
    """Echoes each input upper-cased, one request per step. A poisoned step names its request
    (`StepFailed`), so only that request fails; `always`: every step raises a plain error,
    which fails every request the engine holds."""

    def __init__(self, always: bool = False) -> None:
        self.always = always
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
        with self._lock:
            if not self._queue:
                return []
            request_id, data = self._queue.popleft()
        words = [str(w) for w in data if w is not None]
        if self.always:
            raise RuntimeError(f"poisoned input in {request_id}")
        if "poison" in words:
            raise StepFailed([request_id], f"poisoned input in {request_id}")
        return [EngineOutput(request_id, [w.upper() for w in words], True)]
