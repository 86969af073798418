"""A worker process's stop signals (SIGINT, SIGTERM, SIGHUP), taken by a thread of their own.

Left to the kernel, a process-directed SIGINT or SIGTERM goes to any thread that does not
block it. Python runs its handler on the main thread only, at the main thread's next
bytecode: when the signal landed on a thread blocked in a read, the handler waited for
the worker loop's idle wait to end (up to 1 s; seen as Ctrl-C of `omni-runtime run`
taking 1.04 s in 2 of 30 tries). So the signals are blocked in every thread, and one
thread takes them with `sigwait` as they come.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def block_stop_signals() -> None:
    """Block them in this thread, and so in every thread it starts from now on: call it
    before any thread is started."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def take_stop_signals(stop: Callable[[], None]) -> threading.Thread:
    """Call `stop` for each stop signal, on a thread of its own (a second one stops at once:
    `StageWorker.stop`)."""

    def take() -> None:
        while True:
            signal.sigwait(STOP_SIGNALS)
            stop()

    thread = threading.Thread(target=take, name="stop-signals", daemon=True)
    thread.start()
    return thread
