"""The fault suite's harness: real processes on a real redis-server, a load, a fault, a report.

Every scenario reports the same columns: requests that ended exact (`ok`), with one
error final (`failed`), with a success final but wrong outputs (`wrong` — the worst
outcome), with no final at all (`lost`), outputs that arrived after their request's
final (`dup`), the recovery time (from the fault to the last completion of a request
that was in flight at the fault), leftover keys and Redis memory before and after.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.cluster
import yaml

from omni_runtime.client.client import OmniClient
from omni_runtime.core.types import OrchOutput
from omni_runtime.local.launcher import ProcessGroup, child_env
from omni_runtime.pipeline import load_pipeline
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings

WORKERS = Path(__file__).resolve().parents[2] / "workers"
FULL = os.environ.get("OMNI_FAULTS_FULL") == "1"
"""The full sizes (2,000 requests at concurrency 200) instead of CI's short ones."""

COLUMNS = ("scenario", "ok", "failed", "wrong", "lost", "dup", "recovery_s", "leftover", "mem_kb")


@dataclass
class FaultReport:
    scenario: str
    requests: int
    ok: int = 0
    failed: int = 0
    wrong: int = 0
    lost: int = 0
    duplicated: int = 0
    recovery_s: float | None = None
    leftover_keys: int = 0
    memory_before: int = 0
    memory_after: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    late_successes: dict[str, int] = field(default_factory=dict)
    """Success finals that reached the client after it had ended the request with an
    error, by that error's kind (only a gap, `outputs lost`, may rightly come first)."""
    error_texts: dict[str, str] = field(default_factory=dict)
    """The first full error text of each reason in `errors`."""
    wrong_outputs: dict[str, str] = field(default_factory=dict)
    """What the first few `wrong` requests got, in short: a wrong answer must say how."""
    stall_before_s: float = 0.0
    """The longest wait of any request for its next output (or its first, from its
    submission) that ended before the fault: the load's own stalls."""
    stall_after_s: float = 0.0
    """The same over the waits that ended after the fault (the fault's stall is among them)."""
    resumed_s: float | None = None
    """From the fault to the first success of a request submitted after it: when the
    service was back for new work (None without a fault, or if no such request succeeded)."""

    def line(self) -> str:
        rec = "-" if self.recovery_s is None else f"{self.recovery_s:.2f}"
        mem = f"{self.memory_before // 1024}->{self.memory_after // 1024}"
        return (
            f"{self.scenario:<44} {self.ok:>6} {self.failed:>6} {self.wrong:>5} {self.lost:>5} "
            f"{self.duplicated:>4} {rec:>10} {self.leftover_keys:>8} {mem:>14}"
        )


def header() -> str:
    return (
        f"{'scenario':<44} {'ok':>6} {'failed':>6} {'wrong':>5} {'lost':>5} {'dup':>4} "
        f"{'recovery_s':>10} {'leftover':>8} {'mem_kb':>14}"
    )


class FaultDeployment:
    """One pipeline variant as OS processes in its own namespace, with handles to hurt them."""

    def __init__(
        self,
        redis_url: str,
        tmp_path: Path,
        base: str,
        *,
        orchestrators: int = 1,
        env: dict[str, str] | None = None,
        **changes: Any,
    ) -> None:
        raw = yaml.safe_load((WORKERS / base).read_text())
        for key, value in changes.items():
            if key == "stages":
                for sid, stage_changes in value.items():
                    raw["stages"][sid].update(stage_changes)
            else:
                raw[key] = value
        self.redis_url = redis_url
        self.namespace = f"f{uuid.uuid4().hex[:8]}"
        self.path = tmp_path / f"{self.namespace}.yaml"
        self.path.write_text(yaml.safe_dump(raw))
        self.pipeline = load_pipeline(self.path)
        ttl_s = (env or {}).get("OMNI_HEARTBEAT_TTL_S")  # the children's, for the supervision
        self.settings = Settings(
            redis_url=redis_url,
            namespace=self.namespace,
            block_ms=50,
            heartbeat_ttl_s=float(ttl_s) if ttl_s else None,
        )
        extra = {"OMNI_NAMESPACE": self.namespace, "OMNI_WORKER_MAX_CONCURRENCY": "32"}
        self.env = child_env(redis_url, {**extra, **(env or {})})
        self.group = ProcessGroup(self.path, self.pipeline, self.env, settings=self.settings)
        self.clients = RedisClients.from_url(redis_url)
        self.redis = self.clients.sync()  # a cluster client on a cluster
        self.orchestrators = orchestrators

    def __enter__(self) -> FaultDeployment:
        self.group.start()
        for i in range(1, self.orchestrators):
            self.spawn_orchestrator(f"orchestrator-{i}")
        return self

    def spawn_orchestrator(self, name: str) -> None:
        """One more orchestrator process (it takes the lowest free slot)."""
        base = [sys.executable, "-m", "omni_runtime.cli", "orchestrator"]
        self.group._spawn(name, [*base, "--pipeline", str(self.path), "--mode", self.pipeline.mode])

    def exit_code(self, pid: int) -> int | None:
        for _name, proc, _f in self.group.procs:
            if proc.pid == pid:
                return proc.poll()
        raise LookupError(pid)

    def __exit__(self, *exc: object) -> None:
        self.group.stop()
        self.redis.close()

    def pid(self, name_prefix: str) -> int:
        """The pid of the first process whose name starts with `name_prefix` (e.g. `stage1`)."""
        for name, proc, _f in self.group.procs:
            if name.startswith(name_prefix) and proc.poll() is None:
                return proc.pid
        raise LookupError(f"no live process named {name_prefix}*")

    def signal(self, name_prefix: str, sig: signal.Signals) -> None:
        os.kill(self.pid(name_prefix), sig)

    def signal_pid(self, pid: int, sig: int) -> None:
        os.kill(pid, sig)

    def worker_status(self, stage_id: int) -> list[dict[str, Any]]:
        """The heartbeat documents of the stage's live workers (their counters)."""
        pattern = self.settings.names.heartbeat_pattern(stage_id)
        return [json.loads(self.redis.get(k) or "{}") for k in self.redis.scan_iter(pattern)]

    async def wait_worker_status(
        self, stage_id: int, done: Callable[[list[dict[str, Any]]], bool], timeout_s: float
    ) -> list[dict[str, Any]]:
        """The stage's heartbeat documents once `done` holds of them (or at the deadline)."""
        deadline = time.monotonic() + timeout_s
        docs = self.worker_status(stage_id)
        while not done(docs) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # heartbeats are written once per interval
            docs = self.worker_status(stage_id)
        return docs

    def used_memory(self) -> int:
        """Summed over the primaries on a cluster."""
        if isinstance(self.redis, redis.cluster.RedisCluster):
            per_node = self.redis.info("memory", target_nodes=redis.cluster.RedisCluster.PRIMARIES)
            return sum(int(info["used_memory"]) for info in per_node.values())
        return int(self.redis.info("memory")["used_memory"])

    def leftover_keys(self) -> list[str]:
        """Keys of this namespace other than live processes' heartbeats and stats, orchestrator
        leases and the slot registry, and the (empty) streams' groups."""
        left = []
        for key in self.redis.scan_iter(f"{self.namespace}:*"):
            name = key.decode()
            if ":hb:" in name or ":stats:" in name or ":lease:" in name:  # live, with a TTL
                continue
            if ":gen:" in name or name.endswith((":registry", ":released")):  # slots' own
                continue
            if self.redis.type(key) == b"stream" and self.redis.xlen(key) == 0:
                continue
            left.append(name)
        return left


Expected = Callable[[str], list[tuple[int, Any, bool]]]
Fault = Callable[[], Coroutine[Any, Any, None]]


async def run_load(
    d: FaultDeployment,
    scenario: str,
    prompts: dict[str, str],
    expected: Expected | None,
    concurrency: int,
    fault_after: int | None = None,
    fault: Fault | None = None,
    timeout_s: float = 30.0,
    deadline_s: float = 150.0,
    abort_after_s: Mapping[str, float] | None = None,
    keep: dict[str, list[OrchOutput]] | None = None,
) -> FaultReport:
    """Send `prompts` with at most `concurrency` in flight; inject `fault` once `fault_after`
    requests were submitted; abort each request of `abort_after_s` that long after its
    submission; classify every request's outcome. A request with no final `timeout_s`
    after its last output, or by `deadline_s` for the whole load, is lost. `expected`
    None: any success is right (a model's own answers); `keep` gets every request's
    outputs."""
    report = FaultReport(scenario, len(prompts), memory_before=d.used_memory())
    outcomes: dict[str, list[OrchOutput] | None] = {}
    done_at: dict[str, float] = {}
    waits: list[tuple[float, float]] = []
    """(when a wait ended, how long it was): submission to first output, output to output."""
    after_fault: set[str] = set()
    in_flight_at_fault: set[str] = set()
    fault_at: float | None = None
    submitted = 0
    async with OmniClient(d.settings) as client:
        await client.wait_ready(list(range(d.pipeline.last_stage + 1)), timeout_s=60)
        slots = asyncio.Semaphore(concurrency)
        fault_task: asyncio.Task[None] | None = None

        async def one(rid: str, prompt: str) -> None:
            nonlocal submitted, fault_at, fault_task
            async with slots:
                if fault_at is not None:
                    after_fault.add(rid)
                await client.submit(prompt, request_id=rid)
                submitted += 1
                if fault is not None and submitted == fault_after and fault_task is None:
                    fault_at = time.monotonic()
                    in_flight_at_fault.update(r for r in prompts if r not in done_at)
                    fault_task = asyncio.create_task(fault())
                outs: list[OrchOutput] = []
                last = time.monotonic()
                aborting = None
                if abort_after_s is not None and rid in abort_after_s:
                    aborting = asyncio.create_task(abort_later(rid, abort_after_s[rid]))
                try:
                    async for out in client.stream(rid, timeout_s=timeout_s):
                        now = time.monotonic()
                        waits.append((now, now - last))
                        last = now
                        outs.append(out)
                    outcomes[rid] = outs
                except TimeoutError:
                    outcomes[rid] = None
                done_at[rid] = time.monotonic()
                if aborting is not None:
                    await aborting

        async def abort_later(rid: str, after_s: float) -> None:
            await asyncio.sleep(after_s)  # the fault: an abort at a moment of the request's life
            await client.abort(rid)

        tasks = [asyncio.create_task(one(rid, p)) for rid, p in prompts.items()]
        _done, unfinished = await asyncio.wait(tasks, timeout=deadline_s)
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if fault_task is not None:
            await fault_task
        report.duplicated = client.dropped_outputs
        late = client.metrics.snapshot().get("omni_late_successes_total", {})
        report.late_successes = {dict(labels)["reason"]: int(n) for labels, n in late.items()}
    if keep is not None:
        keep.update({rid: outs for rid, outs in outcomes.items() if outs is not None})
    for rid, outs in outcomes.items():
        if outs is None or not outs or not outs[-1].finished:
            report.lost += 1
        elif outs[-1].error is not None:
            report.failed += 1
            reason = outs[-1].error.split(":")[0]
            report.errors[reason] = report.errors.get(reason, 0) + 1
            report.error_texts.setdefault(reason, outs[-1].error)
        elif expected is None or [(o.stage_id, o.data, o.finished) for o in outs] == expected(
            prompts[rid]
        ):
            report.ok += 1
        else:
            report.wrong += 1
            if len(report.wrong_outputs) < 3:
                report.wrong_outputs[rid] = f"{prompts[rid]!r} -> {_outline(outs)}"
    if fault_at is not None:
        ends = [done_at[r] for r in in_flight_at_fault if r in done_at]
        report.recovery_s = max(ends) - fault_at if ends else 0.0
        report.stall_before_s = max((w for t, w in waits if t < fault_at), default=0.0)
        report.stall_after_s = max((w for t, w in waits if t >= fault_at), default=0.0)
        served = [done_at[r] for r in after_fault if _succeeded(outcomes.get(r))]
        report.resumed_s = min(served) - fault_at if served else None
    report.leftover_keys = len(d.leftover_keys())
    report.memory_after = d.used_memory()
    return report


def _succeeded(outs: list[OrchOutput] | None) -> bool:
    return bool(outs) and outs[-1].finished and outs[-1].error is None  # type: ignore[index]


def seed_final_2(prompt: str) -> list[tuple[int, Any, bool]]:
    """Seed pipeline with finals {2}: one `wav:WORD` output per word, the last finished."""
    words = prompt.split()
    return [(2, f"wav:{w.upper()}", i == len(words) - 1) for i, w in enumerate(words)]


def _outline(outs: list[OrchOutput]) -> str:
    """Outputs in short: (stage, data or its array's dtype and shape, finished) each."""
    shown = [
        (o.stage_id, f"{o.data.dtype}{o.data.shape}" if hasattr(o.data, "dtype") else o.data)
        for o in outs
    ]
    return repr([(*s, o.finished) for s, o in zip(shown, outs, strict=True)])[:2000]
