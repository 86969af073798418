"""Child processes: roles (`python -m benchmarks.roles.X`, JSON lines) and whole pipelines.

A pipeline is started exactly as `omni-runtime run` starts it (`ProcessGroup`:
`python -m omni_runtime.cli orchestrator|worker`), in a namespace of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.harness.redis import delete_keys
from benchmarks.harness.report import ROOT
from omni_runtime.client.client import OmniClient
from omni_runtime.local.launcher import ProcessGroup, child_env
from omni_runtime.pipeline import load_pipeline
from omni_runtime.settings import Settings

T = TypeVar("T")
STARTUP_TIMEOUT_S = 60.0
SEED = ROOT / "workers" / "seed.yaml"
SEED_PROMPT = "hi there"
SEED_EXPECT = [(0, "hi", False), (0, "there", False), (2, "wav:HI", False), (2, "wav:THERE", True)]
"""What the seed pipeline (finals {0, 2}) returns for `SEED_PROMPT`: checked per request."""


def role_env(redis_url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: this Redis, and the repository importable as `benchmarks`."""
    env = child_env(redis_url, extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


class RoleProc:
    """`python -m benchmarks.roles.<module> <args>`: commands on stdin, JSON results on stdout.

    A `module` with a dot in it is a full module path (`benchmarks.peers.ray_driver`)."""

    def __init__(
        self, name: str, module: str, args: Sequence[str], env: dict[str, str], log_dir: Path
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        full = module if "." in module else f"benchmarks.roles.{module}"
        cmd = [sys.executable, "-m", full, *args]
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, bufsize=1,
        )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float) -> dict[str, Any]:
        """The next JSON object the child prints; raises on timeout, exit or `error` (with log)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"{self.name}: no answer in {timeout_s:g} s\n{self.tail()}"
                ) from None
            if line is None:
                code = self.proc.wait(5)
                raise RuntimeError(f"{self.name} exited with code {code}\n{self.tail()}")
            if line.startswith("{"):
                result: dict[str, Any] = json.loads(line)
                if "error" in result:
                    raise RuntimeError(f"{self.name}: {result['error']}\n{self.tail()}")
                return result

    def tail(self, lines: int = 15) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(f"    {s}" for s in text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 5.0) -> None:
        """EOF on stdin ends the role; one that does not exit in time is terminated."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_clients(d: Deployment, log_dir: Path, count: int) -> list[RoleProc]:
    """`count` load clients (`benchmarks.roles.client`), each seeing the pipeline ready."""
    stages = ",".join(map(str, d.stage_ids))
    args = ["--namespace", d.namespace, "--stages", stages]
    clients = [RoleProc(f"client{i}", "client", args, d.env, log_dir) for i in range(count)]
    try:
        for c in clients:
            c.recv(STARTUP_TIMEOUT_S + 10)
    except BaseException:
        for c in clients:
            c.stop(1)
        raise
    return clients


def load(
    clients: list[RoleProc], d: Deployment, n: int, concurrency: int, tag: str, prompt: Any,
    expect: list[Any] | None = None, gap_ms: float = 0.0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Split `n` requests and the concurrency over the clients, start them together."""
    start_at = time.monotonic_ns() + 100_000_000
    k = len(clients)
    for i, c in enumerate(clients):
        c.send({"n": n // k + (i < n % k), "concurrency": max(1, concurrency // k),
                "gap_ms": gap_ms, "tag": f"{tag}c{i}", "start_at_ns": start_at,
                "prompt": prompt, "expect": expect})  # fmt: skip
    deadline = time.monotonic() + 60 + n * (gap_ms / 1e3 + 0.05) / max(1, concurrency)
    results = []
    for c in clients:
        while True:  # in slices: a pipeline process that died fails the run at once
            try:
                results.append(c.recv(min(0.5, max(0.0, deadline - time.monotonic()))))
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                d.check_alive()
    return results


def span(results: list[dict[str, Any]]) -> tuple[float, int]:
    """(seconds from the first submit to the last finished output, requests finished) of
    one `load`, over all its clients."""
    t0 = min(res["t_start_ns"] for res in results)
    wall_s = (max(res["t_end_ns"] for res in results) - t0) / 1e9
    return wall_s, sum(len(res["latencies_ns"]) for res in results)


class Deployment:
    """One pipeline (orchestrator + a worker per stage replica) as processes, own namespace."""

    def __init__(
        self, redis_url: str, pipeline_path: Path, tag: str, mode: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.redis_url = redis_url
        self.namespace = f"bench-{tag}-{uuid.uuid4().hex[:8]}"
        self.pipeline = load_pipeline(pipeline_path, mode=mode)
        self.mode = self.pipeline.mode
        self.env = role_env(redis_url, {"OMNI_NAMESPACE": self.namespace, **(extra_env or {})})
        self.settings = Settings(redis_url=redis_url, namespace=self.namespace)
        self.group = ProcessGroup(pipeline_path, self.pipeline, self.env)
        self.stage_ids = list(range(self.pipeline.last_stage + 1))

    def start(self) -> Deployment:
        self.group.start()
        return self

    async def wait_ready(self) -> None:
        async with OmniClient(self.settings) as client:
            await watched([self], client.wait_ready(self.stage_ids, STARTUP_TIMEOUT_S), 70)

    def pids(self) -> dict[str, int]:
        """Process name (`orchestrator`, `stage0-thinker-0`, ...) -> pid."""
        return {name: proc.pid for name, proc, _log in self.group.procs}

    def check_alive(self) -> None:
        self.group.check_alive()

    def stop(self) -> None:
        self.group.stop()
        delete_keys(self.redis_url, f"{self.namespace}:*")


async def watched(deployments: Sequence[Deployment], work: Awaitable[T], timeout_s: float) -> T:
    """Await `work` within `timeout_s`, failing fast (with its log) if a process dies."""
    task = asyncio.ensure_future(work)
    deadline = time.monotonic() + timeout_s
    try:
        while not task.done():
            for d in deployments:
                d.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"benchmark step did not finish within {timeout_s:g} s")
            await asyncio.wait({task}, timeout=0.2)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
