"""CPU an idle pipeline burns: every orchestrator and worker process, both modes, same run.

`workers/omni.yaml` deployed in sequential and streaming mode at once, warmed up
with two requests each, then left with no request in flight for a window. Per
process: on-CPU ns of all its threads (`/proc/<pid>/task/*/schedstat`; `stat`'s
10 ms ticks are too coarse over a few seconds) as % of one core.

Baseline: the idle redis-server over the same window (a C server's own
housekeeping, `hz 10`). Ratio: process / redis-server. Each orchestrator also
gets a row of its wakes per second (its threads' voluntary context switches:
each is one sleep ended), against the redis-server's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from benchmarks.harness import scenario
from benchmarks.harness.cpu import proc_cpu_ns, proc_cpu_s, proc_wakes
from benchmarks.harness.procs import Deployment, watched
from benchmarks.harness.redis import server_pid
from benchmarks.harness.report import ROOT, Row, ratio
from omni_runtime.client.client import OmniClient

OMNI = ROOT / "workers" / "omni.yaml"
WORKER_TARGET_PCT = 0.5
"""An idle worker: its reads block for seconds (ended at once on stop), it beats once a second."""
ORCHESTRATOR_TARGET_PCT = 0.5
"""An idle orchestrator: its reads block for seconds, it looks once a second."""
ORCHESTRATOR = "orchestrator"


@dataclass(frozen=True)
class Sizes:
    window_s: float
    settle_s: float


FULL = Sizes(window_s=5.0, settle_s=1.0)
QUICK = Sizes(window_s=3.0, settle_s=0.5)


def cpu_s(pid: int) -> float | None:
    ns = proc_cpu_ns(pid)
    return ns / 1e9 if ns is not None else proc_cpu_s(pid)


async def warm_up(d: Deployment) -> None:
    async with OmniClient(d.settings) as client:
        for _ in range(2):
            async for out in client.generate("warm up"):
                if out.error is not None:
                    raise RuntimeError(f"{d.mode}: warm-up request failed: {out.error}")


Measured = tuple[str, str, float, float | None]
"""(mode, process, % of a core, wakes per second)."""


async def measure(ctx: scenario.Context, sizes: Sizes) -> list[Measured]:
    """Per pipeline process, and for the redis-server."""
    deployments = [Deployment(ctx.redis_url, OMNI, f"idle-{m[:3]}", mode=m) for m in ("sequential", "streaming")]  # fmt: skip
    try:
        for d in deployments:
            d.start()
        for d in deployments:
            await d.wait_ready()
            await watched(deployments, warm_up(d), 60)
        await asyncio.sleep(sizes.settle_s)
        pids: list[tuple[str, str, int]] = [
            (d.mode, name, pid) for d in deployments for name, pid in d.pids().items()
        ]
        if (redis_pid := server_pid(ctx.redis_url)) is not None:
            pids.append(("-", "redis-server", redis_pid))
        c0 = {pid: cpu_s(pid) for _m, _n, pid in pids}
        w0 = {pid: proc_wakes(pid) for _m, _n, pid in pids}
        t0 = time.monotonic()
        await watched(deployments, asyncio.sleep(sizes.window_s), sizes.window_s + 10)
        elapsed = time.monotonic() - t0
        c1 = {pid: cpu_s(pid) for _m, _n, pid in pids}
        w1 = {pid: proc_wakes(pid) for _m, _n, pid in pids}
    finally:
        for d in deployments:
            d.stop()
    return [
        (mode, name, 100 * (b - a) / elapsed, per_s(w0[pid], w1[pid], elapsed))
        for mode, name, pid in pids
        if (a := c0[pid]) is not None and (b := c1[pid]) is not None
    ]


def per_s(before: int | None, after: int | None, elapsed: float) -> float | None:
    return None if before is None or after is None else (after - before) / elapsed


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    measured = asyncio.run(measure(ctx, sizes))
    redis = next((m for m in measured if m[1] == "redis-server"), None)
    redis_pct, redis_wakes = (redis[2], redis[3]) if redis is not None else (None, None)
    rows = []
    for mode, name, pct, wakes in measured:
        is_redis = name == "redis-server"
        target = ORCHESTRATOR_TARGET_PCT if name == ORCHESTRATOR else WORKER_TARGET_PCT
        rows.append(Row(
            "idle_cpu", name if is_redis else f"{mode}: {name}", "% of one core", "%", pct,
            baseline="" if is_redis else "idle redis-server",
            baseline_value=None if is_redis else redis_pct,
            ratio=None if is_redis else ratio(pct, redis_pct), ratio_of="" if is_redis else "CPU",
            target="" if is_redis else f"<= {target:g} %",
            met=None if is_redis else pct <= target,
            notes=[f"{sizes.window_s:g} s window, no request in flight"] if is_redis else [],
        ))  # fmt: skip
        if name == ORCHESTRATOR and wakes is not None:
            rows.append(Row(
                "idle_cpu", f"{mode}: {name} wakes", "wakes per second", "/s", wakes,
                baseline="idle redis-server", baseline_value=redis_wakes,
                ratio=ratio(wakes, redis_wakes), ratio_of="wakes",
                notes=["voluntary context switches of all its threads"],
            ))  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("idle_cpu", __doc__, run, FULL, QUICK))
