"""Start the local pipeline's processes by forking a parent that has imported the runtime once.

A fresh interpreter per process pays the runtime's imports (redis, pydantic, numpy) on
every start, and the processes of a pipeline share the machine's cores. A forked child
inherits the parent's imported modules and is ready at once (`benchmarks/startup.py`
measures both). Each child is still its own OS process with its own log file, PID and
signals; it runs the same command line a spawned one would, through the entry point the
command line hands down (`Children`): this module never imports the CLI back.

Forking is safe only from a parent with one thread and no running event loop (a thread
holding a lock at the fork would leave it held forever in the child): `can_fork` says
when, and the launcher spawns fresh interpreters otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO


@dataclass(frozen=True, slots=True)
class Children:
    """What a forked child runs, given by the command line that forks it."""

    main: Callable[[list[str]], int]
    """The command line's entry point: the child's exit code for its arguments."""
    modules: tuple[str, ...] = ()
    """What every child needs: imported once, in the parent, before the first fork."""
    prepare: Callable[[], None] | None = None
    """Run in the parent before the imports (e.g. building the children's parsers)."""


def can_fork() -> bool:
    """A Linux parent with only its main thread and no event loop running (macOS system
    libraries are not fork-safe once loaded, and Python spawns there by default too)."""
    if not sys.platform.startswith("linux") or threading.active_count() != 1:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Stop signals wait while a child is started and registered, and arrive as this ends.

    `run` and `serve` turn a stop signal into a KeyboardInterrupt. Raised inside `os.fork`
    (by its at-fork callbacks: logging's lock), it is printed as "Exception ignored" and
    lost: `serve` went on serving after a SIGTERM, a traceback in its log. Raised between
    the fork and the child's registration, the child would be left out of the stop."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers run on the main thread only: nothing to hold here
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def release_stop_signals() -> None:
    """In a new child, once its handlers are its own: the mask it inherited from
    `stop_signals_held` (through a fork, and an exec too) must not hold them."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def preload(children: Children) -> None:
    """Import what the children run (a missing optional module is the child's business)
    and prepare what they parse, once, in the parent."""
    if children.prepare is not None:
        children.prepare()
    for name in children.modules:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


class ForkedProcess:
    """The part of `subprocess.Popen` the launcher uses, for a forked child."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; `subprocess.TimeoutExpired` after `timeout` seconds. Woken by the
        exit itself (a pidfd, Linux >= 5.3), not by polling; elsewhere it polls."""
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        pidfd = _pidfd(self.pid) if self.poll() is None else None
        try:
            while (code := self.poll()) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
                if pidfd is not None:
                    select.select([pidfd], [], [], left)
                else:
                    time.sleep(delay if left is None else min(delay, left))
                    delay = min(delay * 2, 0.02)
        finally:
            if pidfd is not None:
                os.close(pidfd)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _pidfd(pid: int) -> int | None:
    """A descriptor readable once `pid` has exited, or None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux, an old kernel, or already reaped
        return None


def fork_main(
    main: Callable[[list[str]], int],
    argv: list[str],
    env: dict[str, str],
    log: IO[bytes],
    inherited: Iterable[IO[bytes]] = (),
    fresh: Iterable[str] = (),
    at_start: Callable[[], None] | None = None,
) -> ForkedProcess:
    """Fork a child running `main(argv)` with environment `env`, output to `log`.

    The child never returns into the caller's code: it leaves through `os._exit`.
    `inherited` are the parent's files the child must not keep (its siblings' logs).
    `fresh` are packages the child imports again itself, as a new process would: the
    stage code, which the parent imported only to check its options and which may
    depend, when imported, on the child's environment. `at_start` runs first thing in the
    child (`parent_death.exit_with_parent`).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedProcess(pid)
    code = 1
    try:
        if at_start is not None:
            at_start()
        code = _child(main, argv, env, log, inherited, fresh)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # a forked child never returns into the parent's code
        traceback.print_exc()
    finally:
        try:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:  # whatever the flushes raised: the exit comes all the same
            os._exit(code)


def _child(
    main: Callable[[list[str]], int],
    argv: list[str],
    env: dict[str, str],
    log: IO[bytes],
    inherited: Iterable[IO[bytes]],
    fresh: Iterable[str],
) -> int:
    """As a fresh interpreter would start: default signals, stdin closed, output to `log`."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # `run` and `serve` take it themselves
    release_stop_signals()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    for f in inherited:
        f.close()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(env)
    for package in fresh:
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]
    return main(argv)
