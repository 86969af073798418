"""`omni-runtime serve` as a process on a free loopback port, for the benchmarks and the
end-to-end tests: the HTTP and WebSocket front door exactly as users run it.

`ServeProcess(log, *args)` runs `python -m omni_runtime.cli serve ARGS --port P` (the
whole pipeline, or with `--redis-url` the front door of one that runs already) with no
`OMNI_*` setting but those it is given; `for_deployment` is the front door of a
benchmark's `Deployment`.
Ready once `/ready` answers 200; stopped with SIGTERM (it stops what it started).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import httpx

from benchmarks.harness.procs import Deployment
from benchmarks.harness.report import ROOT
from omni_runtime.local.launcher import free_port

READY_DEADLINE_S = 90.0
POLL_S = 0.1
STOP_TIMEOUT_S = 30.0


class ServeProcess:
    def __init__(
        self,
        log_path: Path,
        *args: str,
        env: Mapping[str, str] | None = None,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable,
            "-m",
            "omni_runtime.cli",
            "serve",
            *args,
            "--port",
            str(self.port),
        ]
        base = os.environ if base_env is None else base_env
        self.env = {k: v for k, v in base.items() if not k.startswith("OMNI_")} | dict(env or {})
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self._proc is not None, "not started"
        return self._proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> ServeProcess:
        """Start it and wait until it is ready; if it exits or is not ready in time, it is
        stopped and the error carries the end of its log."""
        self._log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + READY_DEADLINE_S
        try:
            while not self._ready():
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"serve not ready in {READY_DEADLINE_S:g} s\n{self.log()}")
                time.sleep(POLL_S)  # the next look at /ready
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def check_alive(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"serve exited with code {self._proc.returncode}\n{self.log()}")

    def log(self) -> str:
        """The end of what it printed."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-4000:]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL past `STOP_TIMEOUT_S`; again, a no-op."""
        proc = self._proc
        if proc is None or self._log.closed:
            return
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._log.close()

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def for_deployment(
    d: Deployment, pipeline: Path, log_dir: Path, env: Mapping[str, str] | None = None
) -> ServeProcess:
    """The front door of `d`'s pipeline, on its Redis and namespace."""
    args = ["--pipeline", str(pipeline), "--mode", d.mode, "--redis-url", d.redis_url,
            "--namespace", d.namespace]  # fmt: skip
    return ServeProcess(log_dir / f"serve-{d.namespace}.log", *args, env=env, base_env=d.env)
