"""The scheduler loop's turn, taken by whichever thread brings the loop work.

A function stage's loop pass is cheap: hand inputs to the engine, take its outputs, queue
their writes. Waking the loop's own thread for it costs a thread switch per hand-off
(more when the interpreter lock is busy: docs/performance.md), and a request crosses three
of them per stage: input read → loop, stage code → loop, chunk received → loop. So the
thread that delivers the work (the input reader, the pool thread whose stage code just
emitted, the chunk receiver) runs the pass itself when no other thread is running one, and
only wakes the loop when one is; that pass then runs again on the loop's thread.

Passes still run one at a time, under one lock, so the core, the engine's bookkeeping and
the ChunkAdapter see a single scheduler as before: only which thread plays it changes. A
step engine (a class) keeps its own thread: its `step()` runs the model and may take long,
which must not hold up the thread that read an input or received a chunk.

A pass run this way may also start stage calls the engine knows to be quick (`defer`):
those run on the same thread once the pass has let go of the lock, instead of waking a
pool thread for them; then one more pass there takes all their outputs (one write for
the lot, as from a pool), and may start more calls. A loop, never recursion.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
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
        self._local = threading.local()
        """Per thread: `calls`, the deferred calls it will run (None: not delivering);
        `in_pass`, whether it is in a pass it runs for `deliver`; `again`, whether a deferred
        call delivered work (a pass is due once the calls have run)."""

    def defer(self, call: Callable[[], None]) -> bool:
        """Run `call` on this thread after its pass, if it is a delivering thread in one;
        False (not taken) on any other thread, the loop's own included."""
        local = self._local
        if not getattr(local, "in_pass", False):
            return False
        local.calls.append(call)
        return True

    def deliver(self) -> None:
        """Work was handed to the loop: run a pass here if no thread is in one, else wake
        the loop (whose pass in progress, or next one, takes the work). From within a
        deferred call, the pass waits until the calls queued with it have run: their
        outputs then leave together, as a pool's do from the loop's next pass."""
        local = self._local
        if getattr(local, "calls", None) is not None:
            local.again = True
            return
        if not (self.shared and self._open) or not self.lock.acquire(blocking=False):
            self._wake.set()
            return
        calls: deque[Callable[[], None]] = deque()
        local.calls, local.again = calls, False
        try:
            self._pass_held()
            while calls:
                while calls:
                    calls.popleft()()
                if not local.again:
                    break
                local.again = False
                if not self.lock.acquire(blocking=False):
                    self._wake.set()  # the loop's own pass takes what the calls brought
                    break
                self._pass_held()  # (it may defer more calls: the loop goes on)
        finally:
            local.calls = None
        # Hand the interpreter lock over now: the pass woke a pool thread for the stage
        # call (or the output thread), which would otherwise wait for this thread's next
        # blocking call (its next read's packing) to run (docs/performance.md).
        time.sleep(0)

    def _pass_held(self) -> None:
        """One pass, `lock` already held (and released here), deferring allowed."""
        local = self._local
        local.in_pass = True
        try:
            if self._open and self.failure is None:
                self._run_pass()
        except BaseException as e:  # the loop's thread decides what a failed pass means
            self.failure = e
            self._wake.set()
        finally:
            local.in_pass = False
            self.lock.release()

    def close(self) -> None:
        """The loop has ended: no thread runs a pass any more."""
        with self.lock:
            self._open = False
