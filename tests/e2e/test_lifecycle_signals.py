"""`run` and `serve` stopped by a signal, as a user or a supervisor stops them: SIGTERM,
SIGINT and SIGHUP to the process alone or to its whole process group, and SIGKILL. Within
`STOP_BOUND_S` no process they started is left, their private redis-server included
(it runs in a session of its own: a group's signal never reaches it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.serving import free_port
from tests.e2e.test_cli import OMNI, OUTPUT_LINE, ROOT, cli_env
from tests.e2e.test_run_lifecycle import (
    LONG_PROMPT,
    START_DEADLINE_S,
    descendants,
    running,
    workers_taking_stop_signals,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]

STOP_BOUND_S = 2.0
"""From the signal to every process gone (measured: docs/operations.md, "Stopping")."""
GONE_DEADLINE_S = 30.0
"""How long the test waits before it calls what is left a leak (and kills it)."""
STOP_SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
TARGETS = ["process", "group"]


class Launched:
    """A `run` or `serve` in a process group of its own, like a shell's job."""

    def __init__(self, args: list[str]) -> None:
        # its log directory and its Redis's files go here, removed by `close`: a process
        # SIGKILLed, as `close` may kill it, deletes nothing of its own
        self.tmp = tempfile.mkdtemp(prefix="launched-")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_runtime.cli", *args],
            cwd=ROOT,
            env=cli_env(TMPDIR=self.tmp),  # no Redis URL: it starts its own redis-server
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        stdout = self.proc.stdout
        assert stdout is not None
        self._reader = threading.Thread(target=lambda: self.lines.extend(stdout), daemon=True)
        self._reader.start()
        self.started: dict[int, str] = {}

    def output(self) -> str:
        return "".join(self.lines)

    def all_started(self) -> dict[int, str]:
        """Every process it started, once they all run (its workers take stop signals)."""
        assert self.proc.poll() is None, f"it ended early:\n{self.output()}"
        self.started = descendants(self.proc.pid)
        assert "redis-server" in self.started.values(), self.started
        assert len(self.started) >= 5, self.started  # redis-server, orchestrator, 3 workers
        wait_until(lambda: workers_taking_stop_signals(self.started) == 3, 10)
        return self.started

    def left(self) -> list[str]:
        return [f"{pid} {name}" for pid, name in self.started.items() if running(pid)]

    def stop_with(self, sig: int, target: str) -> float:
        """Seconds from sending `sig` until it and everything it started are gone."""
        sent_at = time.monotonic()
        if target == "group":
            os.killpg(self.proc.pid, sig)
        else:
            os.kill(self.proc.pid, sig)
        with contextlib.suppress(AssertionError):  # the caller's assertion says what is left
            wait_until(lambda: self.proc.poll() is not None and not self.left(), GONE_DEADLINE_S)
        return time.monotonic() - sent_at

    def close(self) -> None:
        for pid in [*self.started, self.proc.pid]:  # a leak must not outlive the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(timeout=10)  # at EOF: every holder of the pipe has exited
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def launched(*args: str) -> Iterator[Launched]:
    job = Launched(list(args))
    try:
        yield job
    finally:
        job.close()


def run_in_mid_request() -> Launched:
    return Launched(["run", "--pipeline", OMNI, LONG_PROMPT])


def wait_first_output(run: Launched) -> None:
    wait_until(
        lambda: run.proc.poll() is not None or any(OUTPUT_LINE.match(x) for x in run.lines),
        START_DEADLINE_S,
    )


def serve_ready(job: Launched, port: int) -> bool:
    assert job.proc.poll() is None, f"serve exited early:\n{job.output()}"
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def report(what: str, took_s: float) -> None:
    print(f"\n{what}: everything gone {took_s:.3f} s after the signal")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_stops_run_and_everything_it_started(sig: int, target: str) -> None:
    with launched("run", "--pipeline", OMNI, LONG_PROMPT) as run:
        wait_first_output(run)
        run.all_started()
        took_s = run.stop_with(sig, target)
        report(f"run, {signal.Signals(sig).name} to the {target}", took_s)
        assert run.left() == [], run.left()
        assert took_s < STOP_BOUND_S, f"{took_s:.2f} s\n{run.output()}"
        assert run.proc.returncode == 128 + sig, run.output()
        assert "Traceback" not in run.output()
        assert "did not stop in time" not in run.output()


def test_sigkill_of_run_takes_everything_it_started_with_it() -> None:
    """Nothing of `run` runs any more: the kernel kills its children (`parent_death`)."""
    with launched("run", "--pipeline", OMNI, LONG_PROMPT) as run:
        wait_first_output(run)
        run.all_started()
        took_s = run.stop_with(signal.SIGKILL, "process")
        report("run, SIGKILL", took_s)
        assert run.left() == [], run.left()
        assert took_s < STOP_BOUND_S, f"{took_s:.2f} s"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_stops_serve_and_everything_it_started(sig: int, target: str) -> None:
    port = free_port()
    with launched("serve", "--pipeline", OMNI, "--port", str(port)) as serve:
        wait_until(lambda: serve_ready(serve, port), START_DEADLINE_S)
        serve.all_started()
        took_s = serve.stop_with(sig, target)
        report(f"serve, {signal.Signals(sig).name} to the {target}", took_s)
        assert serve.left() == [], serve.left()
        assert took_s < STOP_BOUND_S, f"{took_s:.2f} s\n{serve.output()}"
        assert serve.proc.returncode == 0, serve.output()
        assert "Traceback" not in serve.output()


def test_sigkill_of_serve_takes_everything_it_started_with_it() -> None:
    port = free_port()
    with launched("serve", "--pipeline", OMNI, "--port", str(port)) as serve:
        wait_until(lambda: serve_ready(serve, port), START_DEADLINE_S)
        serve.all_started()
        took_s = serve.stop_with(signal.SIGKILL, "process")
        report("serve, SIGKILL", took_s)
        assert serve.left() == [], serve.left()
        assert took_s < STOP_BOUND_S, f"{took_s:.2f} s"
