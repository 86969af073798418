"""One-command local run: a Redis, the orchestrator and every stage worker as subprocesses.

Redis comes from, in order: the configured URL; a `redis-server` on PATH,
started on a free loopback port; an embedded fakeredis TCP server in this
process (pure Python, needs no install, slower — fine for a demo).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import redis

from omni_runtime.errors import FatalError, StartupTimeoutError
from omni_runtime.pipeline import PipelineConfig

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_ping(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            if client.ping():
                return
        except redis.exceptions.RedisError as e:
            if time.monotonic() > deadline:
                raise StartupTimeoutError(
                    f"Redis at {url} did not answer within {timeout_s:g}s: {e}"
                ) from e
            time.sleep(0.02)
        finally:
            client.close()


@contextlib.contextmanager
def local_redis(url: str | None, startup_timeout_s: float) -> Iterator[tuple[str, str]]:
    """Yield `(url, how)`: the given URL, a private redis-server, or an embedded server."""
    if url is not None:
        yield url, "configured"
        return
    exe = shutil.which("redis-server")
    if exe is not None:
        port = free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        try:
            wait_for_ping(url, startup_timeout_s)
            yield url, f"redis-server on port {port}"
        finally:
            proc.terminate()
            proc.wait(10)
        return
    with embedded_redis() as url:
        wait_for_ping(url, startup_timeout_s)
        yield url, "embedded fakeredis server"


@contextlib.contextmanager
def embedded_redis() -> Iterator[str]:
    from fakeredis import TcpFakeServer

    class NoDelayServer(TcpFakeServer):
        """TCP_NODELAY on accepted sockets: without it every pipeline stalls ~40 ms (Nagle)."""

        def get_request(self) -> tuple[socket.socket, Any]:
            sock, addr = super().get_request()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock, addr

    server = NoDelayServer(("127.0.0.1", 0))
    server.daemon_threads = True
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, name="embedded-redis", daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.shutdown()
        server.server_close()


class ProcessGroup:
    """The orchestrator and workers of one pipeline, each its own OS process."""

    def __init__(self, pipeline_path: Path, pipeline: PipelineConfig, env: dict[str, str]) -> None:
        self.pipeline_path = pipeline_path
        self.pipeline = pipeline
        self.env = env
        self.procs: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []
        self.log_dir = Path(tempfile.mkdtemp(prefix="omni-runtime-"))
        self.final_logs: dict[str, str] = {}

    def start(self) -> None:
        base = [sys.executable, "-m", "omni_runtime.cli"]
        common = ["--pipeline", str(self.pipeline_path), "--mode", self.pipeline.mode]
        self._spawn("orchestrator", [*base, "orchestrator", *common])
        for stage in self.pipeline.stages[: self.pipeline.last_stage + 1]:
            for r in range(stage.replicas):
                name = f"stage{stage.id}-{stage.name}-{r}"
                self._spawn(name, [*base, "worker", *common, "--stage", str(stage.id)])

    def _spawn(self, name: str, cmd: list[str]) -> None:
        logfile = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        proc = subprocess.Popen(cmd, env=self.env, stdout=logfile, stderr=subprocess.STDOUT)
        self.procs.append((name, proc, logfile))

    def check_alive(self) -> None:
        """Fail fast, with the dead process's last log lines, instead of waiting on a timeout."""
        for name, proc, _f in self.procs:
            code = proc.poll()
            if code is not None:
                raise FatalError(f"{name} exited with code {code}:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 20) -> str:
        text = self.final_logs.get(name)
        if text is None:
            text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM everyone (graceful), SIGKILL stragglers; keeps the logs readable by `tail`."""
        if self.final_logs:
            return
        for _name, proc, _f in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, proc, logfile in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                proc.kill()
                proc.wait()
            logfile.close()
            self.final_logs[name] = (self.log_dir / f"{name}.log").read_text(errors="replace")
        shutil.rmtree(self.log_dir, ignore_errors=True)


def child_env(redis_url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMNI_REDIS_URL"] = redis_url
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env
