"""One-command local run: a Redis, the orchestrator and every stage worker as OS processes.

Redis comes from, in order: the configured URL; a `redis-server` on PATH,
started on a free loopback port (`RedisServer`, also what the tests, the
benchmarks and CI start); an embedded fakeredis TCP server in this process
(pure Python, needs no install, slower — fine for a demo).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from pydantic_core import to_jsonable_python

from omni_runtime.errors import FatalError
from omni_runtime.local.forked import (
    Children,
    ForkedProcess,
    can_fork,
    fork_main,
    preload,
    release_stop_signals,
    stop_signals_held,
)
from omni_runtime.local.parent_death import exit_with_parent
from omni_runtime.local.redis_cluster import RedisCluster as RedisCluster
from omni_runtime.local.redis_server import RedisServer as RedisServer
from omni_runtime.local.redis_server import free_port as free_port
from omni_runtime.local.redis_server import ping as ping
from omni_runtime.local.redis_server import redis_server_binary as redis_server_binary
from omni_runtime.local.redis_server import wait_for_ping as wait_for_ping
from omni_runtime.local.stalls import StallWatch
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings

log = logging.getLogger(__name__)


@contextlib.contextmanager
def local_redis(url: str | None, startup_timeout_s: float) -> Iterator[tuple[str, str]]:
    """Yield `(url, how)`: the given URL, a private redis-server, or an embedded server."""
    with starting_redis(url, startup_timeout_s) as ready:
        yield ready()


@contextlib.contextmanager
def starting_redis(
    url: str | None, startup_timeout_s: float
) -> Iterator[Callable[[], tuple[str, str]]]:
    """`local_redis` in two steps: a private redis-server is launched on entry, and the
    function yielded waits until it answers and returns `(url, how)`. In between the
    caller does the rest of its start-up (imports, forks) while the server starts."""
    if url is not None:
        yield lambda: (url, "configured")
        return
    if redis_server_binary() is not None:
        server = RedisServer(timeout_s=startup_timeout_s).launch()
        try:

            def ready() -> tuple[str, str]:
                server.wait_ready()
                return server.url, f"redis-server on port {server.port}"

            yield ready
        finally:  # nothing to keep: no need to wait for its cron to act on a SIGTERM
            server.stop(now=True)
        return
    with embedded_redis() as embedded:

        def ready_embedded() -> tuple[str, str]:
            wait_for_ping(embedded, startup_timeout_s)
            return embedded, "embedded fakeredis server"

        yield ready_embedded


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


RESTART_LIMIT = 3
"""`restart_dead`: how often one process may die within `RESTART_WINDOW_S` and be started again."""
RESTART_WINDOW_S = 60.0


class ProcessGroup:
    """The orchestrator and workers of one pipeline, each its own OS process.

    With `fork` (what `run` and `serve` give: the command line's entry point, `Children`)
    the processes are forked from this one once it has imported the runtime (`forked`),
    when it safely can, instead of each starting an interpreter and importing it again.

    Each process dies with this one, however it ends (`parent_death`); `args` are added
    to each one's command line (`run`'s and `serve`'s logging flags). Given the processes'
    `settings`, `restart_dead` also kills a process that stalled (`stalls.py`)."""

    def __init__(
        self,
        pipeline_path: Path,
        pipeline: PipelineConfig,
        env: dict[str, str],
        *,
        fork: Children | None = None,
        args: Sequence[str] = (),
        settings: Settings | None = None,
    ) -> None:
        self.pipeline_path = pipeline_path
        self.pipeline = pipeline
        self.env = env
        self.fork = fork
        self.args = list(args)
        self.settings = settings
        self.procs: list[tuple[str, subprocess.Popen[bytes] | ForkedProcess, IO[bytes]]] = []
        self.log_dir = Path(tempfile.mkdtemp(prefix="omni-runtime-"))
        self.final_logs: dict[str, str] = {}
        self.metrics_ports: dict[str, int] = {}
        """With OMNI_METRICS_PORT=P in `env`, process i (orchestrator first) serves on P + i."""
        self.commands: dict[str, tuple[list[str], Mapping[str, str] | None]] = {}
        self.process_ids: dict[str, str] = {}
        """The orchestrator's and each worker's name in Redis (`--orchestrator-id`,
        `--worker-id`), new for each process it runs as."""
        self.deaths: dict[str, list[float]] = {}
        """`restart_dead`: when each process died, over the last `RESTART_WINDOW_S`."""
        self.heartbeats: dict[str, str] = {}
        """The orchestrator's and each worker's heartbeat key (`restart_dead`'s stall check)."""
        self._stalls: StallWatch | None = None

    def start(self) -> None:
        if self.fork is not None and can_fork():
            preload(self.fork)
        base = [sys.executable, "-m", "omni_runtime.cli"]
        common = ["--pipeline", str(self.pipeline_path), "--mode", self.pipeline.mode]
        common += self.args
        self._spawn("orchestrator", [*base, "orchestrator", *common])
        for stage in self.pipeline.stages[: self.pipeline.last_stage + 1]:
            for r in range(stage.replicas):
                # a stage's name is free text: its process's log file and Redis name are not
                name = f"stage{stage.id}-{re.sub(r'[^A-Za-z0-9._-]', '_', stage.name)}-{r}"
                self._spawn(name, [*base, "worker", *common, "--stage", str(stage.id)])

    def _spawn(
        self,
        name: str,
        cmd: list[str],
        extra_env: Mapping[str, str] | None = None,
        *,
        again_at: int | None = None,
    ) -> None:
        """Start one process; `extra_env` adds to (or overrides) the group's variables.
        `again_at`: it replaces the dead process at that index of `procs`, on its port,
        its log continued."""
        self.commands[name] = (cmd, extra_env)
        cmd = cmd + self._identity(name, cmd, again=again_at is not None)
        env = {**self.env, **(extra_env or {})}
        base = env.get("OMNI_METRICS_PORT", "").strip()
        at_start = exit_with_parent()  # per start: the kernel follows the starting thread
        if base.isdigit() and int(base) > 0:  # one port each: the same one would fail all but one
            port = self.metrics_ports.get(name) if again_at is not None else None
            port = self.metrics_ports[name] = port or int(base) + len(self.procs)
            env = {**env, "OMNI_METRICS_PORT": str(port)}
            log.info("%s serves /metrics on port %d", name, port)
        mode = "ab" if again_at is not None else "wb"
        logfile = open(self.log_dir / f"{name}.log", mode)  # noqa: SIM115 (closed in stop)
        proc: subprocess.Popen[bytes] | ForkedProcess
        with stop_signals_held():  # a stop signal comes once the child is in `procs`
            if self.fork is not None and can_fork():  # cmd[3:]: after `python -m omni_runtime.cli`
                siblings = [f for _n, _p, f in self.procs]
                fresh = self._stage_packages()
                proc = fork_main(self.fork.main, cmd[3:], env, logfile, siblings, fresh, at_start)
            else:
                proc = subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=logfile,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_released(at_start),
                )
            if again_at is None:
                self.procs.append((name, proc, logfile))
            else:
                self.procs[again_at][2].close()
                self.procs[again_at] = (name, proc, logfile)

    def _identity(self, name: str, cmd: list[str], *, again: bool) -> list[str]:
        """A process's name in Redis, new for each process it runs as; started in a dead
        one's place, it takes that one's work over at once (`--replaces`), not once the
        dead one's heartbeat or leases expired."""
        role = cmd[3]  # after `python -m omni_runtime.cli`
        if role not in ("orchestrator", "worker"):
            return []
        dead = self.process_ids.get(name) if again else None
        given_name = self.process_ids[name] = f"{name}-{uuid.uuid4().hex[:8]}"
        if self.settings is not None:
            names = self.settings.names
            self.heartbeats[name] = (
                names.orchestrator_process_heartbeat(given_name)
                if role == "orchestrator"
                else names.stage_heartbeat(int(cmd[cmd.index("--stage") + 1]), given_name)
            )
        given = [f"--{role}-id", given_name]
        return given + (["--replaces", dead] if dead else [])

    def _stage_packages(self) -> set[str]:
        """The top-level packages of the pipeline's own code (entries, forward function)."""
        entries = [stage.entry for stage in self.pipeline.stages]
        entries += [self.pipeline.forward] if self.pipeline.forward else []
        return {e.partition(":")[0].split(".")[0] for e in entries} - {"omni_runtime"}

    def check_alive(self) -> None:
        """Fail fast, with the dead process's last log lines, instead of waiting on a timeout."""
        for name, proc, _f in self.procs:
            code = proc.poll()
            if code is not None:
                raise FatalError(f"{name} exited with code {code}:\n{self.tail(name)}")

    def restart_dead(self, now: float | None = None) -> list[str]:
        """Start again each process that died, and return their names: `serve` keeps
        serving through a crash (a request that killed its worker, the kernel's OOM killer),
        its requests in flight taken over as from any dead replica (`docs/operations.md`).

        A process that died more than `RESTART_LIMIT` times in `RESTART_WINDOW_S` is not
        started again: the group fails with its last log lines, as `check_alive` would,
        since it would fail every request it is given (a model that does not load, a Redis
        that refuses it). The limit is never below `OMNI_MAX_DELIVERIES`: a request that
        kills whoever runs it does so that often before it is dead-lettered."""
        now = time.monotonic() if now is None else now
        self._kill_stalled()
        deliveries = self.env.get("OMNI_MAX_DELIVERIES", "")
        limit = max(RESTART_LIMIT, int(deliveries) if deliveries.isdigit() else 0)
        started = []
        for index, (name, proc, _f) in enumerate(self.procs):
            code = proc.poll()
            if code is None:
                continue
            deaths = [t for t in self.deaths.get(name, []) if now - t < RESTART_WINDOW_S]
            deaths.append(now)
            self.deaths[name] = deaths
            if len(deaths) > limit:
                raise FatalError(
                    f"{name} exited with code {code} and died {len(deaths)} times in "
                    f"{RESTART_WINDOW_S:.0f} s: not started again. Its last lines:\n"
                    f"{self.tail(name)}"
                )
            log.error(
                "%s exited with code %d; starting it again (%d of %d in %.0f s). Its last lines:\n%s",
                name, code, len(deaths), limit, RESTART_WINDOW_S, self.tail(name),
            )  # fmt: skip
            cmd, extra_env = self.commands[name]
            self._spawn(name, cmd, extra_env, again_at=index)
            started.append(name)
        return started

    def _kill_stalled(self) -> None:
        """Kill each process that stopped beating while alive (`stalls.py`): `restart_dead`
        then starts it again in its place."""
        live = {n: self.heartbeats[n] for n, p, _f in self.procs if n in self.heartbeats}
        live = {n: key for n, key in live.items() if self._proc(n).poll() is None}
        if self.settings is None or self.settings.redis_url is None or not live:
            return
        if self._stalls is None:
            client = RedisClients.from_url(self.settings.redis_url).sync()
            self._stalls = StallWatch(client, self.settings.heartbeat_ttl_ms / 1000)
        for name in self._stalls.stalled(live):
            proc = self._proc(name)
            silent_s = self._stalls.missing_for_s(live[name])
            log.error(
                "%s (pid %d) is alive but has beaten no heartbeat for %.0f s: killed, to be "
                "started again", name, proc.pid, silent_s,
            )  # fmt: skip
            proc.send_signal(signal.SIGKILL)  # not waited for here, in `serve`'s event loop:
            # reaped and started again below, or in the next round

    def _proc(self, name: str) -> subprocess.Popen[bytes] | ForkedProcess:
        return next(p for n, p, _f in self.procs if n == name)

    def tail(self, name: str, lines: int = 20) -> str:
        text = self.final_logs.get(name)
        if text is None:
            text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(
        self, timeout_s: float = 10.0, *, keep_failed_logs: bool = False, failed: bool = False
    ) -> Path | None:
        """Stop everyone, SIGKILL stragglers after `timeout_s`; keeps the logs readable by `tail`.

        Each process gets SIGTERM then SIGINT: an orchestrator stops on either, a worker
        stops on the first and, on the second, without draining its requests in flight
        (`StageWorker.stop`): whoever would read their outputs is stopping too.

        The log directory is deleted, except with `keep_failed_logs` when the caller's run
        `failed` or a process exited non-zero (or was killed): then it stays for a
        post-mortem, and is returned."""
        if self.final_logs:
            return None
        for _name, proc, _f in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGINT)
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


def _released(at_start: Callable[[], None] | None) -> Callable[[], None]:
    """A spawned child's first step: an exec keeps the signal mask, not the handlers."""

    def first() -> None:
        release_stop_signals()
        if at_start is not None:
            at_start()

    return first


def child_env(redis_url: str, extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment for a child, with `extra` over it (None: unset) and the
    Redis URL over both."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    for name, value in (extra or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env["OMNI_REDIS_URL"] = redis_url
    return env


def settings_env(settings: Settings) -> dict[str, str | None]:
    """Every setting as its `OMNI_*` variable, for `child_env`: the processes `run` and
    `serve` start then use exactly the settings they were given, whether by a flag, a
    variable or the settings file (whose precedence was applied here, once). None unsets
    a variable (a setting that is None); the settings file is not read again."""
    env: dict[str, str | None] = {"OMNI_SETTINGS_FILE": None}
    for name, value in settings.model_dump().items():
        env[f"OMNI_{name.upper()}"] = _env_value(value)
    return env


def _env_value(value: object) -> str | None:
    """How pydantic-settings reads the value back from a variable (`inf` included)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float | Path):
        return str(value)
    return json.dumps(to_jsonable_python(value))  # a complex setting: JSON, as pydantic reads it
