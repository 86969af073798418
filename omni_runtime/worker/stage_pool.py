"""The threads a function or generator stage runs on: started as needed, up to a bound.

`concurrent.futures.ThreadPoolExecutor` makes a `Future` per call, each with a
`Condition` of its own, and runs a done-callback through it: for a light stage that was
the largest share of the worker's CPU (`submit` and `Condition.__init__`:
docs/performance.md). A stage call needs no result and no future: each
thread takes the next call off one queue, runs it, and reports it done.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Call = tuple[Callable[..., object], tuple[Any, ...]]


class StagePool:
    """Up to `size` threads named `<name>_<n>`; `done` is called once per call submitted,
    after it ran (or raised), or when `shutdown` dropped it unstarted. The threads are
    daemons: a pool never shut down, or stage code that ignores its abort, does not keep
    the process from exiting (the engine's `close` says what it left running)."""

    def __init__(self, size: int, name: str, done: Callable[[], None]) -> None:
        self._size = size
        self._name = name
        self._done = done
        self._calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        """Released by a thread each time it finishes a call: one that may take the next."""
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._shut = False

    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue the call; a new thread only when none is idle and the bound allows."""
        with self._lock:
            if self._shut:
                raise RuntimeError("the stage pool was shut down")
            self._calls.put((fn, args))
            if self._idle.acquire(blocking=False) or len(self._threads) >= self._size:
                return
            name = f"{self._name}_{len(self._threads)}"
            thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._threads.append(thread)
        thread.start()

    def shutdown(self) -> None:
        """No more calls: those not started yet are dropped (each reported done), and every
        thread exits once its current call returns."""
        with self._lock:
            self._shut = True
            threads = len(self._threads)
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._done()
        for _ in range(threads):
            self._calls.put(None)

    def join(self, timeout_s: float) -> None:
        """Wait for the threads to exit (after `shutdown`), at most `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # stage code's own errors are handled inside `fn`
                log.exception("a stage call raised past its handler")
            finally:
                self._done()
            self._idle.release()
