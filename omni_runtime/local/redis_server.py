"""Private Redis servers for local runs, tests, benchmarks and CI.

`RedisServer` is a `redis-server` on a free loopback port (`redis_cluster` makes a
cluster of them). Nothing is downloaded: the binary is `$OMNI_REDIS_SERVER` or the one
on PATH.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from omni_runtime.errors import FatalError, StartupTimeoutError
from omni_runtime.local.parent_death import exit_with_parent

LOWEST_PORT = 10_000
"""Ports below are left to the well-known and registered services."""


def free_port() -> int:
    """A loopback TCP port free right now (another process may still take it: callers retry)."""
    return free_ports(1)


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports free right now, below the ephemeral
    range: a port the kernel hands out itself may be taken by any process's next outgoing
    connection before it is bound (another listener may still take it: callers retry)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32_768  # Linux's default start; elsewhere, as good a bound
    for _attempt in range(100):
        base = random.randrange(LOWEST_PORT, max(LOWEST_PORT + 1, ephemeral - count))
        with contextlib.ExitStack() as bound:
            try:
                for port in range(base, base + count):
                    bound.enter_context(socket.create_server(("127.0.0.1", port)))
            except OSError:
                continue
        return base
    raise FatalError(f"no {count} consecutive free loopback ports in {LOWEST_PORT}-{ephemeral}")


def ping(url: str, timeout_s: float = 0.5) -> bool:
    """One PING without retries; False (not an exception) while nothing answers."""
    import redis  # here: `launch` starts a server before the process has imported redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis.from_url(
        url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


def shutdown_now(url: str, timeout_s: float = 0.5) -> None:
    """`SHUTDOWN NOSAVE`, best effort: the server exits as it answers (no reply comes)."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        client.shutdown(nosave=True)
    except redis.exceptions.RedisError:
        pass  # the connection closing under it is the expected answer
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
    Started from a main thread on Linux, the server dies with the process that started
    it, even a SIGKILLed one (`parent_death`).
    """

    def __init__(
        self,
        binary: str | None = None,
        log_path: Path | None = None,
        timeout_s: float = 10.0,
        extra_args: tuple[str, ...] = (),
        pick_port: Callable[[], int] = free_port,
    ) -> None:
        self.binary = binary or redis_server_binary()
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.extra_args = extra_args
        self.pick_port = pick_port
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, attempts: int = 3) -> RedisServer:
        return self.launch().wait_ready(attempts)

    def launch(self) -> RedisServer:
        """Start the server on a free port and return at once: the caller does its other
        start-up work (imports, forks) while the server starts, then calls `wait_ready`."""
        if self.binary is None:
            raise FatalError("no redis-server on PATH (install it, or set OMNI_REDIS_SERVER)")
        self.port = self.pick_port()
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no", *self.extra_args]
        out: IO[bytes] | int = subprocess.DEVNULL
        if self.log_path is not None:
            out = open(self.log_path, "ab")  # noqa: SIM115 (the child keeps its own copy)
        try:
            # Its own session: a Ctrl-C in the terminal must not kill it before the
            # processes using it have stopped (whoever started it stops it, last).
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=exit_with_parent(),
            )
        except OSError as e:
            raise FatalError(f"cannot start {self.binary}: {e}") from e
        finally:
            if not isinstance(out, int):
                out.close()
        return self

    def wait_ready(self, attempts: int = 3) -> RedisServer:
        """Return once the launched server answers PING; if it died at start (its port
        taken in between), launch it again on another port, `attempts` launches in all."""
        error = ""
        for attempt in range(attempts):
            if self.proc is None or attempt > 0:
                self.launch()
            assert self.proc is not None
            deadline = time.monotonic() + self.timeout_s
            delay = 0.002  # a server starts in ~10 ms: poll often at first, then back off
            while self.proc.poll() is None and time.monotonic() < deadline:
                if ping(self.url):
                    return self
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
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

    def stop(self, timeout_s: float = 5.0, *, now: bool = False) -> None:
        """SIGTERM, SIGKILL after `timeout_s`; always reaped. Idempotent.

        `now`: first ask it for `SHUTDOWN NOSAVE`, done at once, where a SIGTERM waits for
        the server's next cron tick (up to 100 ms): for a server with nothing to keep."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if now and proc.poll() is None:
            shutdown_now(self.url)
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
