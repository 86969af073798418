"""A loop that stops making progress stops its process.

Each watched loop reports its progress each time it goes around (`Progress.beat`: a count
and a monotonic time) and says whether it has work in hand (`pending`). A loop with work
in hand that has not gone around for `OMNI_WATCHDOG_S` (plus its own longest legitimate
wait, `slack_s`) is wedged: a bug, a blocking call, a lock never released. Its process is
then alive but of no use, and whatever it holds (an orchestrator's slot lease, a worker's
heartbeat) keeps anyone else from taking its work over. So the watchdog logs where the
loop is stuck (its thread's stack, or its task's), lets the process give back what it
holds (`on_stuck`, which the process bounds itself), and exits with `WEDGED_EXIT_CODE`.

`Watchdog.check` is the decision alone, on a given clock: no thread, testable as is.
`Watchdog.start` adds the thread that checks periodically, and the exit.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised

log = logging.getLogger(__name__)

WEDGED_EXIT_CODE = 70
"""The exit code of a process stopped by its watchdog (`EX_SOFTWARE`: an internal error)."""
REDIS_CALL_S = 5.0
"""redis-py's default socket timeout: the longest one Redis call of the runtime may block."""
MAX_PERIOD_S = 1.0
"""The watchdog looks at least this often (and ten times per `limit_s`)."""


def redis_retries_s(retry_attempts: int, retry_max_s: float) -> float:
    """The longest a bounded Redis retry may keep a loop from going around: every attempt
    timing out, each followed by the longest delay. A loop that waits only on Redis
    (a worker's I/O threads) is given this on top of the watchdog's limit."""
    return retry_attempts * (REDIS_CALL_S + retry_max_s)


def thread_stack(thread_id: int | None) -> str:
    """Where the thread is now (its Python stack), for the log line of a wedged loop."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return "(its thread is gone)"
    return "".join(traceback.format_stack(frame))


class Progress:
    """One loop's progress. `beat` is two stores and a clock read: cheap enough for
    every round of a hot loop."""

    __slots__ = ("at", "name", "pending", "rounds", "slack_s", "thread_id", "where")

    def __init__(
        self,
        name: str,
        pending: Callable[[], bool] = lambda: True,
        *,
        slack_s: float = 0.0,
        where: Callable[[], str] | None = None,
    ) -> None:
        self.name = name
        self.pending = pending
        """Whether the loop has work in hand now (read from the watchdog's thread)."""
        self.slack_s = slack_s
        """The loop's own longest legitimate wait with work in hand (a Redis retry)."""
        self.where = where
        """Describes where the loop is; default: the stack of the thread that last beat."""
        self.rounds = 0
        self.at = time.monotonic()
        self.thread_id: int | None = None

    def beat(self) -> None:
        """The loop went around (called by the loop itself, on whichever thread runs it)."""
        self.at = time.monotonic()  # before the count: a reader that sees the count sees it
        self.thread_id = threading.get_ident()
        self.rounds += 1

    def describe(self) -> str:
        """Where the loop is; a diagnostic that raises must never stop the watchdog."""
        where = self.where or functools.partial(thread_stack, self.thread_id)
        described = foreign.call(where)
        return f"(cannot tell: {described.error!r})" if isinstance(described, Raised) else described


@dataclass(frozen=True)
class Stuck:
    """A wedged loop, as the watchdog saw it."""

    name: str
    idle_s: float
    where: str


class Watchdog:
    """Watches loops (`watch`, `forget`); `check` tells which are wedged."""

    def __init__(
        self,
        limit_s: float,
        on_stuck: Callable[[list[Stuck]], None] = lambda _stuck: None,
        *,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.limit_s = limit_s
        self.on_stuck = on_stuck
        self.clock = clock
        self._exit = exit
        self._lock = threading.Lock()
        self._loops: dict[int, Progress] = {}
        self._seen: dict[int, tuple[int, float]] = {}
        """id(progress) → (its rounds when first seen pending at that count, since when)."""
        self._last_check = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def period_s(self) -> float:
        return min(MAX_PERIOD_S, self.limit_s / 10)

    def watch(self, progress: Progress) -> Progress:
        with self._lock:
            self._loops[id(progress)] = progress
        return progress

    def forget(self, progress: Progress) -> None:
        with self._lock:
            self._loops.pop(id(progress), None)
            self._seen.pop(id(progress), None)

    def check(self, now: float | None = None) -> list[Stuck]:
        """The loops pending since longer than the limit (and their slack) without going
        around. A loop counts as pending from the later of its last beat and the previous
        check that found it idle: work that just came in is not taken for old work."""
        now = self.clock() if now is None else now
        stuck: list[Stuck] = []
        with self._lock:
            loops = list(self._loops.items())
        for key, p in loops:
            if not p.pending():
                self._seen.pop(key, None)
                continue
            rounds, at = p.rounds, p.at
            seen = self._seen.get(key)
            if seen is None:  # pending since the last check at most
                seen = (rounds, max(at, self._last_check))
            elif seen[0] != rounds:  # it went around since: pending since its last beat
                seen = (rounds, at)
            self._seen[key] = seen
            idle_s = now - seen[1]
            if idle_s > self.limit_s + p.slack_s:
                stuck.append(Stuck(p.name, idle_s, p.describe()))
        self._last_check = now
        return stuck

    def start(self) -> Watchdog:
        """Check every `period_s` on a daemon thread; a wedged loop ends the process."""
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """The process is stopping on its own: its loops may end with work in hand."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            stuck = self.check()
            if stuck and not self._stop.is_set():
                self.fire(stuck)
                return

    def fire(self, stuck: list[Stuck]) -> None:
        """Log each wedged loop and where it is, let the process give back what it holds,
        exit."""
        for s in stuck:
            log.critical(
                "%s made no progress for %.1f s with work in hand (OMNI_WATCHDOG_S=%g); "
                "the process exits so that another takes its work over. It is stuck at:\n%s",
                s.name,
                s.idle_s,
                self.limit_s,
                s.where.rstrip(),
            )
        gave_back = foreign.call(self.on_stuck, stuck)
        if isinstance(gave_back, Raised):  # the process exits next whatever failed
            log.error("giving back what the process holds failed", exc_info=gave_back.error)
        for handler in logging.getLogger().handlers:  # the exit skips every cleanup
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit(WEDGED_EXIT_CODE)
