"""Children that die with the process that started them, however it ends.

`run` and `serve` stop what they started when they are asked to (a signal, the end of the
run). A SIGKILL leaves them no chance: the orchestrator, the workers and the private
redis-server would live on as orphans, the server holding its port. So each child asks
the kernel, as it starts, for a SIGKILL when its parent dies (`PR_SET_PDEATHSIG`, Linux).
SIGKILL, not a stop signal: a parent gone without a word leaves nobody to drain for, and a
child whose own loop is wedged would ignore anything gentler.

The kernel sends it when the *thread* that started the child ends, so only a main thread
asks for it (a child started from a pool thread would die with that thread). Elsewhere
(not Linux, another thread) children are started as before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def exit_with_parent() -> Callable[[], None] | None:
    """A function to run in a new child as it starts (a fork's first step, or Popen's
    `preexec_fn`): the kernel kills the child when this process dies. None where the
    kernel cannot (not Linux) or should not (not the main thread)."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: not after the fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    kill, zero = ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0)

    def at_start() -> None:
        prctl(PR_SET_PDEATHSIG, kill, zero, zero, zero)
        if os.getppid() != parent:  # the parent died before the call above: at once, then
            os.kill(os.getpid(), signal.SIGKILL)

    return at_start
