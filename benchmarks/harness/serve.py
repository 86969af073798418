"""`omni-runtime serve` as a process in front of a benchmark's `Deployment`.

`python -m omni_runtime.http.serve --pipeline P --mode M --redis-url URL --namespace NS`
on a free loopback port: the HTTP and WebSocket front door exactly as users run it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.harness.procs import Deployment
from benchmarks.harness.report import ROOT

READY_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Serve:
    def __init__(
        self, d: Deployment, pipeline: Path, log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{d.namespace}.log"
        self.args = [
            sys.executable, "-m", "omni_runtime.http.serve", "--pipeline", str(pipeline),
            "--mode", d.mode, "--redis-url", d.redis_url, "--namespace", d.namespace,
            "--port", str(self.port),
        ]  # fmt: skip
        self.env = {k: v for k, v in d.env.items() if not k.startswith("OMNI_")} | (env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Serve:
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with code {self.proc.returncode}\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"serve not ready in {READY_TIMEOUT_S:g} s\n{self.tail()}")
            time.sleep(0.1)
        return self

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"serve exited with code {self.proc.returncode}\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(f"    {s}" for s in text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.proc = None
