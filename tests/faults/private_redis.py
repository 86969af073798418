"""A redis-server of one scenario's own, restartable on the same port.

The session's shared server must never be restarted under other tests; a scenario
that restarts Redis starts this one instead (`--save ''`, AOF as asked, in a tmp dir).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import TracebackType

from omni_runtime.local.launcher import free_port, wait_for_ping


class PrivateRedis:
    def __init__(self, workdir: Path, aof: bool = False) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("no redis-server on PATH")
        self.exe = exe
        self.workdir = workdir
        self.aof = aof
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        persistence = (
            ("--appendonly", "yes", "--appendfsync", "always")
            if self.aof
            else ("--appendonly", "no")
        )
        self.proc = subprocess.Popen(
            [
                *(self.exe, "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--dir", str(self.workdir), *persistence),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_ping(self.url, 20)

    def kill(self) -> None:
        """SIGKILL: what was not persisted is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def __enter__(self) -> PrivateRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
