"""Step engines that fail on purpose: on inputs that ask for it, or on every input."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from omni_runtime.stage_api import EngineOutput, StepFailed


class PoisonEngine:
    """Echoes each input upper-cased, one request per step. A poisoned step names its request
    (`StepFailed`), so only that request fails; `always`: every step raises a plain error,
    so that every request ends up blamed alone and fails."""

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


class BatchPoisonEngine:
    """Continuous batching, as a served model runs: every step, each request it holds emits
    its next word upper-cased (the last one finished). A step raises a plain `RuntimeError`
    whenever it holds a request with the word "poison": the engine cannot say which request
    broke it, so the worker resets it (here: builds it anew) and finds the poison itself.
    `step_ms` paces a step, so that requests share batches."""

    def __init__(self, step_ms: float = 0.0) -> None:
        self.step_ms = step_ms
        self._lock = threading.Lock()
        self._words: dict[str, list[str]] = {}
        """Each request's words still to come, next first."""

    def add_request(self, request_id: str, data: Any) -> None:
        with self._lock:
            self._words[request_id] = [str(w) for w in data if w is not None]

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._words.pop(request_id, None)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._words)

    def step(self) -> list[EngineOutput]:
        if self.step_ms > 0:
            time.sleep(self.step_ms / 1000)  # the batch's decode step
        with self._lock:
            if any("poison" in words for words in self._words.values()):
                raise RuntimeError(f"poisoned input in a batch of {len(self._words)}")
            outputs = []
            for rid, words in list(self._words.items()):
                outputs.append(EngineOutput(rid, words.pop(0).upper(), not words))
                if not words:
                    del self._words[rid]
        return outputs
