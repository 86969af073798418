"""A private Redis Sentinel deployment for tests, benchmarks and CI.

One primary, its replicas and three sentinels (`redis-server <conf> --sentinel`), all
on free loopback ports; `url` is the `redis+sentinel://` URL clients use. The sentinels'
timings are settings because a test wants a failover in seconds, not sentinel's default
of half a minute.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from omni_runtime.errors import FatalError, StartupTimeoutError
from omni_runtime.local.parent_death import exit_with_parent
from omni_runtime.local.redis_server import RedisServer, free_port, ping, redis_server_binary

SERVICE = "omni"


class RedisSentinelSet:
    """`replicas` replicas of one primary, watched by `sentinels` sentinels (quorum 2).

    `start()` returns once the replicas are in sync and every sentinel knows the primary,
    every replica and every other sentinel: from then on a failover can happen.
    """

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        timeout_s: float = 30.0,
    ) -> None:
        if sentinels < 2:
            raise FatalError(f"a quorum of 2 needs at least 2 sentinels, got {sentinels}")
        self.n_replicas = replicas
        self.n_sentinels = sentinels
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.timeout_s = timeout_s
        self.servers: list[RedisServer] = []
        """The primary first, as started; a failover promotes one of the others."""
        self.sentinel_ports: list[int] = []
        self._sentinels: list[subprocess.Popen[bytes]] = []
        self.dir: Path | None = None

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> RedisSentinelSet:
        binary = redis_server_binary()
        if binary is None:
            raise FatalError("no redis-server on PATH (install it, or set OMNI_REDIS_SERVER)")
        self.dir = Path(tempfile.mkdtemp(prefix="omni-redis-sentinel-"))
        with contextlib.ExitStack() as unless_started:  # no server is left running
            unless_started.callback(self.stop)
            primary = self._start_server(binary, "primary", ())
            for i in range(self.n_replicas):
                self._start_server(
                    binary, f"replica{i}", ("--replicaof", "127.0.0.1", str(primary.port))
                )
            for i in range(self.n_sentinels):
                self._start_sentinel(binary, i, primary.port)
            self._wait_ready()
            unless_started.pop_all()
        return self

    def _start_server(self, binary: str, name: str, args: tuple[str, ...]) -> RedisServer:
        """A server in a directory of its own: a full resync writes an RDB file there."""
        assert self.dir is not None
        where = self.dir / name
        where.mkdir()
        server = RedisServer(
            binary, where / "server.log", self.timeout_s, ("--dir", str(where), *args)
        )
        self.servers.append(server.start())
        return server

    def _start_sentinel(self, binary: str, i: int, primary_port: int) -> None:
        assert self.dir is not None
        port = free_port()
        conf = self.dir / f"sentinel{i}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {self.dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        with open(self.dir / f"sentinel{i}.log", "ab") as log:
            proc = subprocess.Popen(
                [binary, str(conf), "--sentinel"],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=exit_with_parent(),
            )
        self._sentinels.append(proc)
        self.sentinel_ports.append(port)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._ready():
            for proc in self._sentinels:
                if proc.poll() is not None:
                    raise StartupTimeoutError(f"a sentinel exited at start: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise StartupTimeoutError(
                    f"Redis Sentinel on ports {self.sentinel_ports} was not ready within "
                    f"{self.timeout_s:g}s: {self.log_tail()}"
                )
            time.sleep(0.05)

    def _ready(self) -> bool:
        import redis as redis_py

        for server in self.servers[1:]:
            client = redis_py.Redis(port=server.port, socket_timeout=2)
            try:
                if client.info("replication").get("master_link_status") != "up":
                    return False
            finally:
                client.close()
        for port in self.sentinel_ports:
            client = redis_py.Redis(port=port, socket_timeout=2)
            try:
                state = cast(dict[str, Any], client.sentinel_master(SERVICE))
            except redis_py.RedisError:
                return False
            finally:
                client.close()
            if (
                int(state["num-slaves"]) < self.n_replicas
                or int(state["num-other-sentinels"]) < self.n_sentinels - 1
            ):
                return False
        return True

    def primary_port(self) -> int | None:
        """The primary's port as the first sentinel that answers says; None if none does."""
        import redis

        for port in self.sentinel_ports:
            client = redis.Redis(port=port, socket_timeout=2)
            try:
                address = client.sentinel_get_master_addr_by_name(SERVICE)
                return int(cast(tuple[str, int], address)[1])
            except (redis.RedisError, TypeError):
                continue
            finally:
                client.close()
        return None

    def server(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def wait_primary_other_than(self, port: int, timeout_s: float) -> int:
        """The new primary's port once the sentinels name one other than `port` and it
        answers as a primary; StartupTimeoutError after `timeout_s`."""
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = self.primary_port()
            if now is not None and now != port and ping(f"redis://127.0.0.1:{now}/0"):
                client = redis.Redis(port=now, socket_timeout=2)
                try:
                    if client.info("replication").get("role") == "master":
                        return now
                finally:
                    client.close()
            time.sleep(0.02)
        raise StartupTimeoutError(f"no failover from port {port} within {timeout_s:g}s")

    def log_tail(self, chars: int = 1500) -> str:
        if self.dir is None:
            return ""
        logs = sorted(self.dir.glob("**/*.log"))
        return " | ".join(f"{p.name}: {p.read_text(errors='replace')[-chars:]}" for p in logs)

    def stop(self) -> None:
        """Stop every process and delete the directory. Idempotent."""
        for proc in self._sentinels:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._sentinels:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._sentinels = []
        for server in self.servers:
            server.stop(now=True)
        self.servers = []
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> RedisSentinelSet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
