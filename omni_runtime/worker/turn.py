"""The scheduler loop's turn, taken by whichever thread brings the loop work.

A function stage's loop pass is cheap: hand inputs to the engine, take its outputs, queue
their writes. Waking the loop's own thread for it costs a thread switch per hand-off
(~0.1 ms on a small VM, more when the interpreter lock is busy), and a request crosses three
of them per stage: input read → loop, stage code → loop, chunk received → loop. So the
thread that delivers the work (the input reader, the pool thread whose stage code just
emitted, the chunk receiver) runs the pass itself when no other thread is running one, and
only wakes the loop when one is; that pass then runs again on the loop's thread.

Passes still run one at a time, under one lock, so the core, the engine's bookkeeping and
the ChunkAdapter see a single scheduler as before: only which thread plays it changes. A
step engine (a class) keeps its own thread: its `step()` runs the model and may take long,
which must not hold up the thread that read an input or received a chunk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class LoopTurn:
    """One pass of the scheduler loop at a time; any delivering thread may run it."""

    def __init__(self, run_pass: Callable[[], None], wake: threading.Event) -> None:
        self._run_pass = run_pass
        self._wake = wake
        self.lock = threading.Lock()
        """Held by the loop's own thread for each of its passes."""
        self.shared = False
        """Whether delivering threads may run a pass (a function stage); else they wake."""
        self._open = True
        self.failure: BaseException | None = None
        """What a pass run by another thread raised: the loop raises it (and so stops)."""

    def deliver(self) -> None:
        """Work was handed to the loop: run a pass here if no thread is in one, else wake
        the loop (whose pass in progress, or next one, takes the work)."""
        if not (self.shared and self._open) or not self.lock.acquire(blocking=False):
            self._wake.set()
            return
        try:
            if self._open and self.failure is None:
                self._run_pass()
        except BaseException as e:  # the loop's thread decides what a failed pass means
            self.failure = e
            self._wake.set()
        finally:
            self.lock.release()
        # Hand the interpreter lock over now: the pass woke a pool thread for the stage
        # call (or the output thread), which would otherwise wait for this thread's next
        # blocking call (its next read's packing) to run (~0.13 ms of a stage here).
        time.sleep(0)

    def close(self) -> None:
        """The loop has ended: no thread runs a pass any more."""
        with self.lock:
            self._open = False
