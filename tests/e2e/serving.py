"""`omni-runtime serve` as a real process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from types import TracebackType

import httpx

from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
READY_DEADLINE_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServeProcess:
    """`python -m omni_runtime.cli serve …`, stopped with SIGTERM (it stops what it started)."""

    def __init__(self, log_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [*args, "--port", str(self.port)]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
        self.env.update(env or {})
        self.log_path = log_path

    def __enter__(self) -> ServeProcess:
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_runtime.cli", "serve", *self.args],
            cwd=ROOT,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until(self._ready, READY_DEADLINE_S)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"serve exited early:\n{self.log()}"
        try:
            return httpx.get(f"{self.url}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
