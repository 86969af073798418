"""One-command local run: a Redis, the orchestrator and every stage worker as subprocesses.

Redis comes from, in order: the configured URL; a `redis-server` on PATH,
started on a free loopback port (`RedisServer`, also what the tests, the
benchmarks and CI start); an embedded fakeredis TCP server in this process
(pure Python, needs no install, slower — fine for a demo).
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
from redis.backoff import NoBackoff
from redis.retry import Retry

from omni_runtime.errors import FatalError, StartupTimeoutError
from omni_runtime.pipeline import PipelineConfig

log = logging.getLogger(__name__)


def free_port() -> int:
    """A loopback TCP port free right now (another process may still take it: callers retry)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ping(url: str, timeout_s: float = 0.5) -> bool:
    """One PING without retries; False (not an exception) while nothing answers."""
    client = redis.Redis.from_url(
        url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


def wait_for_ping(url: str, timeout_s: float) -> None:
    """Return once `url` answers PING; StartupTimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ping(url):
        if time.monotonic() > deadline:
            raise StartupTimeoutError(f"Redis at {url} did not answer within {timeout_s:g}s")
        time.sleep(0.02)


def redis_server_binary() -> str | None:
    """`$OMNI_REDIS_SERVER` if set, else `redis-server` on PATH, else None."""
    return os.environ.get("OMNI_REDIS_SERVER") or shutil.which("redis-server")


class RedisServer:
    """A private `redis-server` on a free loopback port: no persistence, stopped on exit.

    The one way this repository starts a Redis (`omni-runtime run`, the tests'
    session fixture, the benchmarks, CI). `start()` waits for PING within
    `timeout_s`, retries on another port if the server dies at start (a port
    taken in between), and raises StartupTimeoutError with the log's tail;
    FatalError if there is no binary. Use as a context manager, or `start()`/`stop()`.
    """

    def __init__(
        self,
        binary: str | None = None,
        log_path: Path | None = None,
        timeout_s: float = 10.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.binary = binary or redis_server_binary()
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.extra_args = extra_args
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, attempts: int = 3) -> RedisServer:
        if self.binary is None:
            raise FatalError("no redis-server on PATH (install it, or set OMNI_REDIS_SERVER)")
        error = ""
        for _ in range(attempts):
            self.port = free_port()
            cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
            cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no", *self.extra_args]
            out: IO[bytes] | int = subprocess.DEVNULL
            if self.log_path is not None:
                out = open(self.log_path, "ab")  # noqa: SIM115 (the child keeps its own copy)
            try:
                # Its own session: a Ctrl-C in the terminal must not kill it before the
                # processes using it have stopped (whoever started it stops it, last).
                self.proc = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            except OSError as e:
                raise FatalError(f"cannot start {self.binary}: {e}") from e
            finally:
                if not isinstance(out, int):
                    out.close()
            deadline = time.monotonic() + self.timeout_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                if ping(self.url):
                    return self
                time.sleep(0.02)
            error = f"exit code {self.proc.poll()}" if self.proc.poll() is not None else "no PING"
            self.stop()
        raise StartupTimeoutError(
            f"redis-server did not answer PING within {self.timeout_s:g}s ({error})"
            + (f"; log:\n{self.log_tail()}" if self.log_path else "")
        )

    def log_tail(self, chars: int = 2000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, SIGKILL after `timeout_s`; always reaped. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@contextlib.contextmanager
def local_redis(url: str | None, startup_timeout_s: float) -> Iterator[tuple[str, str]]:
    """Yield `(url, how)`: the given URL, a private redis-server, or an embedded server."""
    if url is not None:
        yield url, "configured"
        return
    if redis_server_binary() is not None:
        with RedisServer(timeout_s=startup_timeout_s) as server:
            yield server.url, f"redis-server on port {server.port}"
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
        self.metrics_ports: dict[str, int] = {}
        """With OMNI_METRICS_PORT=P in `env`, process i (orchestrator first) serves on P + i."""

    def start(self) -> None:
        base = [sys.executable, "-m", "omni_runtime.cli"]
        common = ["--pipeline", str(self.pipeline_path), "--mode", self.pipeline.mode]
        self._spawn("orchestrator", [*base, "orchestrator", *common])
        for stage in self.pipeline.stages[: self.pipeline.last_stage + 1]:
            for r in range(stage.replicas):
                name = f"stage{stage.id}-{stage.name}-{r}"
                self._spawn(name, [*base, "worker", *common, "--stage", str(stage.id)])

    def _spawn(self, name: str, cmd: list[str]) -> None:
        env, base = self.env, self.env.get("OMNI_METRICS_PORT", "").strip()
        if base.isdigit() and int(base) > 0:  # one port each: the same one would fail all but one
            port = self.metrics_ports[name] = int(base) + len(self.procs)
            env = {**env, "OMNI_METRICS_PORT": str(port)}
            log.info("%s serves /metrics on port %d", name, port)
        logfile = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        proc = subprocess.Popen(cmd, env=env, stdout=logfile, stderr=subprocess.STDOUT)
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

    def stop(
        self, timeout_s: float = 10.0, *, keep_failed_logs: bool = False, failed: bool = False
    ) -> Path | None:
        """SIGTERM everyone (graceful), SIGKILL stragglers; keeps the logs readable by `tail`.

        The log directory is deleted, except with `keep_failed_logs` when the caller's run
        `failed` or a process exited non-zero (or was killed): then it stays for a
        post-mortem, and is returned."""
        if self.final_logs:
            return None
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
        crashed = any(proc.returncode != 0 for _n, proc, _f in self.procs)
        if keep_failed_logs and (failed or crashed):
            return self.log_dir
        shutil.rmtree(self.log_dir, ignore_errors=True)
        return None


def child_env(redis_url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMNI_REDIS_URL"] = redis_url
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env
