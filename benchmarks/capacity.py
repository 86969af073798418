"""Capacity that grows with processes: throughput with each process capped by a cgroup.

On a small machine the machine is the limit, not the process (two
orchestrators measured 0.85-1.05x of one on 2 cores). Here each process of the
part under test gets a CFS quota of `Sizes.cap` of a core (`benchmarks.harness.cgroups`:
cgroup v1's `cpu.cfs_quota_us` or v2's `cpu.max`), so it is the limit, as on a
machine with a core per process; everything else (Redis, clients, other stages)
runs uncapped and far from its own limit (its share of a core is in the notes).
Every process of the benchmark is in a group of high CPU weight, so other work on
the machine does not take the capped processes' share.

Two parts, each a set of deployments side by side on one Redis (own namespaces),
their loads alternated repetition by repetition so all see the same machine:

* orchestrators: `workers/seed.yaml` with 1 and with 2 orchestrators, each
  orchestrator capped; target 2 >= 1.7x of 1.
* a CPU-bound stage: `benchmarks/stages/capacity.yaml` (one stage spending
  `Sizes.cpu_ms` of CPU per request) with 1, 2 and 4 replicas, each replica capped;
  targets 2 >= 1.8x and 4 >= 3.2x of 1.

requests/s = N / (first submit -> last finished output) over two load-client
processes, median over repetitions. A closed loop's rate at one concurrency is bounded
by its latency as well as by capacity, and more orchestrators each read smaller
batches (more CPU per request): as in `benchmarks/orchestrators.py`, each deployment's
capacity is its best median rate over a sweep of concurrencies (N >= 4 C per load),
the rates at each concurrency in the notes. Each row's notes give every process's share
of a core during its loads, and the capped processes' throttled time (cpu.stat):
a capped process that is not throttled was not the limit.
"""

from __future__ import annotations

import gc
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness import scenario
from benchmarks.harness.cgroups import CpuCaps, unavailable
from benchmarks.harness.cpu import MACHINE, CpuSampler
from benchmarks.harness.procs import SEED, Deployment, RoleProc, load, span, start_clients
from benchmarks.harness.procs import SEED_EXPECT as EXPECT
from benchmarks.harness.procs import SEED_PROMPT as PROMPT
from benchmarks.harness.redis import server_pid
from benchmarks.harness.report import ROOT, Row, ratio
from benchmarks.harness.stats import p50_p99_ms, spread

BURN = ROOT / "benchmarks" / "stages" / "capacity.yaml"
TARGETS = {"2 orchestrators": 1.7, "2 replicas": 1.8, "4 replicas": 3.2}


@dataclass(frozen=True)
class Sizes:
    reps: int
    cap: float
    """Share of a core each capped process gets."""
    orch_requests: int
    orch_concurrency: tuple[int, ...]
    stage_requests: int
    stage_concurrency: tuple[int, ...]
    cpu_ms: float
    """CPU time the stage spends per request."""


FULL = Sizes(reps=5, cap=0.2, orch_requests=2000, orch_concurrency=(256, 1024),
             stage_requests=1500, stage_concurrency=(64,), cpu_ms=2.0)  # fmt: skip
QUICK = Sizes(reps=2, cap=0.2, orch_requests=600, orch_concurrency=(256, 1024),
              stage_requests=400, stage_concurrency=(64,), cpu_ms=2.0)  # fmt: skip


@dataclass
class Part:
    """One deployment under test: what to cap, how to load it, what it measured."""

    config: str
    deployment: Deployment
    capped: str
    """Name prefix of the processes capped (`orchestrator`, `stage0`)."""
    requests: int
    concurrency: tuple[int, ...]
    prompt: object
    expect: list[Any] | None
    clients: list[RoleProc] | None = None


def orchestrators(ctx: scenario.Context, n: int) -> Deployment:
    d = Deployment(ctx.redis_url, SEED, f"cap-orch{n}").start()
    base = [sys.executable, "-m", "omni_runtime.cli", "orchestrator"]
    for i in range(1, n):
        d.group._spawn(f"orchestrator-{i}", [*base, "--pipeline", str(SEED), "--mode", d.mode])
    return d


def replicas(ctx: scenario.Context, n: int, sizes: Sizes) -> Deployment:
    import yaml

    raw = yaml.safe_load(BURN.read_text())
    raw["stages"][0]["replicas"] = n
    raw["stages"][0]["options"]["cpu_ms"] = sizes.cpu_ms
    path = ctx.log_dir / f"capacity-{n}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return Deployment(ctx.redis_url, path, f"cap-rep{n}").start()


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    why = unavailable()
    if why is not None:
        raise SystemExit(f"capacity: cannot cap processes: {why}")
    parts = [
        *(Part(f"{n} orchestrator{'s' * (n > 1)}", orchestrators(ctx, n), "orchestrator",
               sizes.orch_requests, sizes.orch_concurrency, PROMPT, EXPECT) for n in (1, 2)),
        *(Part(f"{n} replica{'s' * (n > 1)}", replicas(ctx, n, sizes), "stage0",
               sizes.stage_requests, sizes.stage_concurrency, "x", [[0, "x", True]])
          for n in (1, 2, 4)),
    ]  # fmt: skip
    caps = CpuCaps()
    m = Measured()
    redis_pid = server_pid(ctx.redis_url)
    try:
        for p in parts:
            p.clients = start_clients(p.deployment, ctx.log_dir, 2)
            load(p.clients, p.deployment, 100, 32, "warm", p.prompt, p.expect)
            for name, pid in p.deployment.pids().items():
                caps.cap(pid, sizes.cap if name.startswith(p.capped) else None)
            for c in p.clients:
                caps.prioritise(c.pid)
        if redis_pid is not None:
            caps.prioritise(redis_pid)
        for rep in range(sizes.reps):
            for p in parts:
                for conc in p.concurrency:
                    measure(p, conc, rep, caps, redis_pid, m)
    finally:
        caps.release()
        for p in parts:
            for c in p.clients or []:
                c.stop()
            p.deployment.stop()
    rows = [row(p, sizes, m) for p in parts]
    by_config = {p.config: r for p, r in zip(parts, rows, strict=True)}
    for config, target in TARGETS.items():
        r = by_config[config]
        base = by_config["1 orchestrator" if "orchestrator" in config else "1 replica"]
        r.baseline, r.baseline_value = base.config, base.value
        r.ratio, r.ratio_of = ratio(r.value, base.value), "rate"
        r.target = f"rate ratio >= {target:g}x"
        r.met = r.ratio is not None and r.ratio >= target and not m.errors.get(config)
    return rows


@dataclass
class Measured:
    """Per config: requests/s of each load by concurrency, and what the loads saw."""

    rates: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    shares: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    throttled: dict[str, float] = field(default_factory=dict)
    latencies: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)


def measure(p: Part, conc: int, rep: int, caps: CpuCaps, redis_pid: int | None,
            m: Measured) -> None:  # fmt: skip
    """One load of `p` at concurrency `conc`, with the CPU of each of its processes."""
    assert p.clients is not None
    capped = {n: pid for n, pid in p.deployment.pids().items() if n.startswith(p.capped)}
    before = sum(caps.throttled_s(pid) for pid in capped.values())
    pids = p.deployment.pids() | {f"client{i}": c.pid for i, c in enumerate(p.clients)}
    if redis_pid is not None:
        pids["redis-server"] = redis_pid
    sampler = CpuSampler(pids)
    gc.collect()
    sampler.start()
    n = max(p.requests, 4 * conc)
    results = load(p.clients, p.deployment, n, conc, f"r{rep}c{conc}", p.prompt, p.expect)
    cpu_s = sampler.stop()
    wall_s, done = span(results)
    m.rates.setdefault(p.config, {}).setdefault(conc, []).append(done / wall_s)
    m.shares.setdefault(p.config, []).append({k: v / wall_s for k, v in cpu_s.items()})
    throttled = sum(caps.throttled_s(pid) for pid in capped.values()) - before
    m.throttled[p.config] = m.throttled.get(p.config, 0.0) + throttled
    for res in results:
        m.latencies.setdefault(p.config, []).extend(res["latencies_ns"])
        m.errors.setdefault(p.config, []).extend(res["errors"])


def row(p: Part, sizes: Sizes, m: Measured) -> Row:
    """The config's peak over the sweep; the curve, CPU shares and throttling in notes."""
    medians = {c: statistics.median(r) for c, r in m.rates[p.config].items()}
    best = max(medians, key=lambda c: medians[c])
    value, lo, hi = spread(m.rates[p.config][best])
    p50, p99 = p50_p99_ms(m.latencies.get(p.config, []))
    shares = m.shares[p.config]
    names = sorted({n for s in shares for n in s})
    mean = {n: sum(s.get(n, 0.0) for s in shares) / len(shares) for n in names}
    errors = m.errors.get(p.config, [])
    notes = [
        f"each {p.capped}* process capped at {sizes.cap:g} core; requests/s by concurrency: "
        + ", ".join(f"c={c} {r:.0f}" for c, r in medians.items())
        + f" (peak at c={best})",
        "share of a core: "
        + ", ".join(f"{n} {v:.2f}" for n, v in mean.items() if n != MACHINE)
        + f"; machine {mean.get(MACHINE, 0.0):.2f}",
        f"capped processes throttled {m.throttled.get(p.config, 0.0):.1f} s in all",
    ]
    if errors:
        notes.append(f"{len(errors)} failed or wrong requests, e.g. {errors[0]}")
    part = "orchestrators" if p.capped == "orchestrator" else "cpu-bound stage"
    return Row(f"capacity: {part}", f"{p.config}, peak", "requests/s", "/s", value, lo, hi,
               p50, p99, notes=notes,
               details={"by_concurrency": medians, "share": mean})  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(scenario.main("capacity", __doc__, run, FULL, QUICK))
