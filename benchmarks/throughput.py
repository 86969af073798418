"""Requests/s end to end: the seed pipeline as real processes, with per-process CPU.

`workers/seed.yaml` (sequential, finals {0, 2}): an orchestrator and one worker per
stage, started as `omni-runtime run` starts them. Load comes from client processes
(`benchmarks.roles.client`, one `OmniClient` each): N requests of "hi there" (4
outputs checked per request) with at most C in flight, one client at C=64 and
C=256, and two clients sharing C=256. requests/s = N / (first submit -> last
finished output), median over repetitions; latency = submit -> finished output.
CPU of every process (`/proc`) is sampled around each repetition; "other" is busy
CPU outside the named processes (a shared machine shows up there).

Baseline: the two-client run's rate is compared with one client at the same total
concurrency, to show whether one client process is the bottleneck.
"""

from __future__ import annotations

import gc
import os
import statistics
from dataclasses import dataclass

from benchmarks.harness import scenario
from benchmarks.harness.cpu import MACHINE, OTHER, SHARED_MACHINE_FRACTION, CpuSampler
from benchmarks.harness.procs import SEED, Deployment, RoleProc, load, span, start_clients
from benchmarks.harness.procs import SEED_EXPECT as EXPECT
from benchmarks.harness.procs import SEED_PROMPT as PROMPT
from benchmarks.harness.redis import server_pid
from benchmarks.harness.report import Row, ratio
from benchmarks.harness.stats import p50_p99_ms, spread

TARGET_RPS = 1000.0


@dataclass(frozen=True)
class Sizes:
    reps: int
    requests: int
    warmup: int
    loads: tuple[tuple[int, int], ...]
    """(client processes, total concurrency) per configuration."""


FULL = Sizes(reps=5, requests=2000, warmup=300, loads=((1, 64), (1, 256), (2, 256)))
QUICK = Sizes(reps=2, requests=400, warmup=100, loads=((1, 64), (1, 256), (2, 256)))


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    d = Deployment(ctx.redis_url, SEED, "throughput").start()
    clients: list[RoleProc] = []
    rows: list[Row] = []
    try:
        clients = start_clients(d, ctx.log_dir, max(k for k, _ in sizes.loads))
        pids = {name.split("-")[0]: pid for name, pid in d.pids().items()}
        if (pid := server_pid(ctx.redis_url)) is not None:
            pids["redis-server"] = pid
        load(clients[:1], d, sizes.warmup, 64, "warm", PROMPT, EXPECT)
        for n_clients, conc in sizes.loads:
            active = clients[:n_clients]
            sampler = CpuSampler(pids | {f"client{i}": c.pid for i, c in enumerate(active)})
            rates: list[float] = []
            latencies: list[int] = []
            errors: list[str] = []
            util: list[dict[str, float]] = []
            for rep in range(sizes.reps):
                gc.collect()
                sampler.start()
                results = load(
                    active, d, sizes.requests, conc, f"r{n_clients}x{conc}n{rep}", PROMPT, EXPECT
                )
                cpu_s = sampler.stop()
                wall_s, done = span(results)
                rates.append(done / wall_s)
                util.append({name: v / wall_s for name, v in cpu_s.items()})
                for res in results:
                    latencies.extend(res["latencies_ns"])
                    errors.extend(res["errors"])
            rows.append(make_row(sizes, n_clients, conc, rates, latencies, errors, util))
    finally:
        for c in clients:
            c.stop()
        d.stop()
    one = next((r for r in rows if r.config == "1 client, c=256"), None)
    for r in rows:
        if r.config.startswith("2 clients") and one is not None:
            r.baseline, r.baseline_value = "1 client, c=256", one.value
            r.ratio, r.ratio_of = ratio(r.value, one.value), "rate"
    return rows


def make_row(
    sizes: Sizes, n_clients: int, conc: int, rates: list[float], latencies: list[int],
    errors: list[str], util: list[dict[str, float]],
) -> Row:  # fmt: skip
    value, lo, hi = spread(rates)
    cpu = {name: statistics.median(u.get(name, 0.0) for u in util) for name in util[0]}
    notes = [
        f"{sizes.requests} requests/rep x {sizes.reps} reps; p50/p99 = submit -> finished output",
        "CPU, % of one core (median of reps): "
        + ", ".join(f"{name} {100 * v:.0f}%" for name, v in cpu.items())
        + f" (of {100 * (os.cpu_count() or 1)}%)",
    ]
    if cpu.get(OTHER, 0.0) > SHARED_MACHINE_FRACTION:
        notes.append(f"WARNING: {100 * cpu[OTHER]:.0f}% of a core outside the benchmark: shared")
    if errors:
        notes.append(f"{len(errors)} failed or wrong requests, e.g. {errors[0]}")
    p50, p99 = p50_p99_ms(latencies)
    return Row(
        "throughput", f"{n_clients} client{'s' * (n_clients > 1)}, c={conc}", "requests/s", "/s",
        value, lo, hi, p50, p99, target=f">= {TARGET_RPS:,.0f}/s",
        met=value >= TARGET_RPS and not errors, notes=notes,
        details={"cpu_fraction_of_core": cpu, "machine_cores_busy": cpu.get(MACHINE)},
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(scenario.main("throughput", __doc__, run, FULL, QUICK))
