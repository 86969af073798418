"""Requests/s of the seed pipeline with 2 orchestrators vs 1, and orchestrator CPU per request.

Two deployments of `workers/seed.yaml` (its stages are CPU-light: word splits and
string prefixes) side by side on one Redis, in namespaces of their own: one with
one orchestrator, one with two (started as `omni-runtime orchestrator` twice).
Repetitions alternate between them, so both see the same machine; the idle one
costs little. Load: two client processes (`benchmarks.roles.client`) sharing
concurrency C, N requests of "hi there" (outputs checked). requests/s = N /
(first submit -> last finished output), median over repetitions. CPU per request
= CPU seconds of the orchestrator processes (summed) / N; every process's share
of a core is in the notes, so the next bottleneck can be read off.

Throughput: a closed loop's rate at one concurrency is bounded by its latency
(Little's law), not only by capacity: more orchestrators each read smaller batches,
so at moderate concurrency they pay more per request for the same rounds. The
capacity of a deployment is its best rate as concurrency grows: a sweep over
`Sizes.sweep` (both deployments alternated at each step, max(N, 4 C) requests per
load) gives each one's curve; the 2-orchestrator peak / the 1-orchestrator peak is
the row with the target (>= 1x). The fixed-concurrency rows are kept beside it,
their ratio reported without a target. A third
deployment, one orchestrator with `OMNI_DURABLE_REQUESTS` off, shows what durable
request state costs in orchestrator CPU. The orchestrator's CPU per request (one
orchestrator, durable) is a row of its own, against the non-durable one's; target
<= 0.35 ms at c = 256 (the full run's concurrency).

Profile: after the measured repetitions, two more loads of the one-orchestrator
deployment run under py-spy (`benchmarks.harness.profile`, not counted: sampling
costs the process a little): a flame graph, `results/orchestrator_profile.svg`, and
the folded stacks, `results/orchestrator_profile.folded`, whose top self-time
functions are in the CPU row's notes.
"""

from __future__ import annotations

import gc
import statistics
import sys
from dataclasses import dataclass

from benchmarks.harness import scenario
from benchmarks.harness.cpu import MACHINE, OTHER, CpuSampler
from benchmarks.harness.procs import SEED, Deployment, RoleProc, load, span, start_clients
from benchmarks.harness.procs import SEED_EXPECT as EXPECT
from benchmarks.harness.procs import SEED_PROMPT as PROMPT
from benchmarks.harness.profile import Profiler, top_self
from benchmarks.harness.redis import server_pid
from benchmarks.harness.report import RESULTS, Row, ratio
from benchmarks.harness.stats import p50_p99_ms, spread

TARGET_RATIO = 1.0
TARGET_CPU_MS = 0.35
"""Orchestrator CPU per seed request, one orchestrator with durable state, at c = 256."""
PROFILE = RESULTS / "orchestrator_profile"
PROFILED = 5000
"""Requests per profiled load: a few seconds of samples, even in a quick run."""


@dataclass(frozen=True)
class Sizes:
    reps: int
    requests: int
    warmup: int
    concurrency: int
    sweep: tuple[int, ...]
    sweep_reps: int


FULL = Sizes(reps=5, requests=2000, warmup=300, concurrency=256,
             sweep=(256, 512, 1024), sweep_reps=4)  # fmt: skip
QUICK = Sizes(reps=2, requests=400, warmup=100, concurrency=128, sweep=(128, 512), sweep_reps=2)
SWEPT = ("1 orchestrator", "2 orchestrators")


CONFIGS = {"1 orchestrator": (1, True), "2 orchestrators": (2, True),
           "1 orchestrator, not durable": (1, False)}  # fmt: skip


def deployment(ctx: scenario.Context, orchestrators: int, durable: bool) -> Deployment:
    env = {"OMNI_DURABLE_REQUESTS": str(durable).lower()}
    d = Deployment(ctx.redis_url, SEED, f"orch{orchestrators}", extra_env=env).start()
    base = [sys.executable, "-m", "omni_runtime.cli", "orchestrator"]
    for i in range(1, orchestrators):
        d.group._spawn(f"orchestrator-{i}", [*base, "--pipeline", str(SEED), "--mode", d.mode])
    return d


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    deps = {c: deployment(ctx, n, durable) for c, (n, durable) in CONFIGS.items()}
    clients: dict[str, list[RoleProc]] = {}
    rates: dict[str, list[float]] = {c: [] for c in CONFIGS}
    cpu_per_req: dict[str, list[float]] = {c: [] for c in CONFIGS}
    util: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
    latencies: dict[str, list[int]] = {c: [] for c in CONFIGS}
    errors: dict[str, list[str]] = {c: [] for c in CONFIGS}
    try:
        for n, d in deps.items():
            clients[n] = start_clients(d, ctx.log_dir, 2)
            load(clients[n], d, sizes.warmup, 64, "warm", PROMPT, EXPECT)
        redis_pid = server_pid(ctx.redis_url)
        for rep in range(sizes.reps):
            for n, d in deps.items():
                pids = {name: pid for name, pid in d.pids().items()}
                pids |= {f"client{i}": c.pid for i, c in enumerate(clients[n])}
                if redis_pid is not None:
                    pids["redis-server"] = redis_pid
                sampler = CpuSampler(pids)
                gc.collect()
                sampler.start()
                results = load(clients[n], d, sizes.requests, sizes.concurrency,
                               f"o{rep}", PROMPT, EXPECT)  # fmt: skip
                cpu_s = sampler.stop()
                wall_s, done = span(results)
                rates[n].append(done / wall_s)
                orch_s = sum(v for name, v in cpu_s.items() if name.startswith("orchestrator"))
                cpu_per_req[n].append(orch_s / max(1, done) * 1e3)
                util[n].append({name: v / wall_s for name, v in cpu_s.items()})
                for res in results:
                    latencies[n].extend(res["latencies_ns"])
                    errors[n].extend(res["errors"])
        curves = sweep(deps, clients, sizes)
        single = "1 orchestrator"
        profile_notes = profile(deps[single], clients[single], sizes)
    finally:
        for cs in clients.values():
            for c in cs:
                c.stop()
        for d in deps.values():
            d.stop()
    rows = [make_row(sizes, c, rates[c], cpu_per_req[c], util[c], latencies[c], errors[c])
            for c in CONFIGS]  # fmt: skip
    one, two, plain = rows
    one.baseline, one.baseline_value = plain.config, plain.value
    one.ratio, one.ratio_of = ratio(one.value, plain.value), "rate"
    two.baseline, two.baseline_value = one.config, one.value
    two.ratio, two.ratio_of = ratio(two.value, one.value), "rate"
    two.notes.append("no target at one concurrency: see the peak rows")
    return [*rows, *peak_rows(curves), cpu_row(sizes, cpu_per_req[one.config],
            cpu_per_req[plain.config], errors[one.config], profile_notes)]  # fmt: skip


Curve = dict[int, tuple[list[float], list[str]]]
"""concurrency → (requests/s of each repetition, failed or wrong requests)."""


def sweep(deps: dict[str, Deployment], clients: dict[str, list[RoleProc]], sizes: Sizes
          ) -> dict[str, Curve]:  # fmt: skip
    """Each swept deployment's rate at each concurrency, the deployments alternated."""
    curves: dict[str, Curve] = {c: {} for c in SWEPT}
    for conc in sizes.sweep:
        n = max(sizes.requests, 4 * conc)
        for rep in range(sizes.sweep_reps):
            for config in SWEPT:
                gc.collect()
                results = load(clients[config], deps[config], n, conc, f"s{conc}r{rep}",
                               PROMPT, EXPECT)  # fmt: skip
                wall_s, done = span(results)
                rates, errors = curves[config].setdefault(conc, ([], []))
                rates.append(done / wall_s)
                for res in results:
                    errors.extend(res["errors"])
    return curves


def peak_rows(curves: dict[str, Curve]) -> list[Row]:
    """Per swept deployment, its best median rate over the sweep; the second's ratio to
    the first is the throughput target."""
    rows = []
    for config, curve in curves.items():
        medians = {conc: statistics.median(rates) for conc, (rates, _) in curve.items()}
        best = max(medians, key=lambda conc: medians[conc])
        value, lo, hi = spread(curve[best][0])
        errors = [e for _, errs in curve.values() for e in errs]
        notes = ["requests/s by concurrency (median of "
                 f"{len(curve[best][0])} loads): "
                 + ", ".join(f"c={conc} {rate:.0f}" for conc, rate in medians.items()),
                 f"peak at c={best}"]  # fmt: skip
        if errors:
            notes.append(f"{len(errors)} failed or wrong requests, e.g. {errors[0]}")
        rows.append(Row("orchestrators", f"{config}, peak over concurrency", "requests/s", "/s",
                        value, lo, hi, notes=notes, details={"by_concurrency": medians}))  # fmt: skip
    one, two = rows
    two.baseline, two.baseline_value = one.config, one.value
    two.ratio, two.ratio_of = ratio(two.value, one.value), "rate"
    two.target = f"rate ratio >= {TARGET_RATIO:g}x"
    failed = any(errs for curve in curves.values() for _, errs in curve.values())
    two.met = two.ratio is not None and two.ratio >= TARGET_RATIO and not failed
    by_c = one.details["by_concurrency"], two.details["by_concurrency"]
    two.notes.append("2 / 1 at each concurrency: " + ", ".join(
        f"c={conc} {by_c[1][conc] / by_c[0][conc]:.2f}x" for conc in by_c[1]))  # fmt: skip
    return rows


def profile(d: Deployment, clients: list[RoleProc], sizes: Sizes) -> list[str]:
    """Two loads under py-spy: a flame graph, then folded stacks; notes on what it found."""
    profiler = Profiler()
    if profiler.available is not None:
        return [f"no profile: {profiler.available}"]
    PROFILE.parent.mkdir(parents=True, exist_ok=True)
    svg, folded = PROFILE.with_suffix(".svg"), PROFILE.with_suffix(".folded")
    for out, fmt in ((svg, "flamegraph"), (folded, "raw")):
        out.unlink(missing_ok=True)
        profiler.start(d.pids()["orchestrator"], out, fmt)
        try:
            load(clients, d, PROFILED, sizes.concurrency, f"p{fmt}", PROMPT, EXPECT)
        finally:
            failed = profiler.stop()
        if failed is not None:
            return [f"no profile: {failed}"]
    busy, top = top_self(folded)
    return [
        f"profile ({busy} busy samples, {PROFILED} requests): flame graph {svg}, "
        f"folded stacks {folded}",
        "most self time: " + "; ".join(f"{frame} {share:.1f}%" for frame, share in top[:8]),
    ]


def cpu_row(
    sizes: Sizes, durable: list[float], plain: list[float], errors: list[str], notes: list[str]
) -> Row:
    value, lo, hi = spread(durable)
    base = statistics.median(plain)
    return Row(
        "orchestrators", f"1 orchestrator, c={sizes.concurrency}", "orchestrator CPU per request",
        "ms", value, lo, hi, baseline="not durable", baseline_value=base,
        ratio=ratio(value, base), ratio_of="CPU", target=f"<= {TARGET_CPU_MS:g} ms",
        met=value <= TARGET_CPU_MS and not errors,
        notes=[f"{len(durable)} reps of {sizes.requests} requests; CPU of the orchestrator "
               "process over each rep / requests", *notes],
    )  # fmt: skip


def make_row(
    sizes: Sizes, config: str, rates: list[float], cpu_ms: list[float],
    util: list[dict[str, float]], latencies: list[int], errors: list[str],
) -> Row:  # fmt: skip
    value, lo, hi = spread(rates)
    cpu = {name: statistics.median(u.get(name, 0.0) for u in util) for name in util[0]}
    per_req = statistics.median(cpu_ms)
    notes = [
        f"{sizes.requests} requests/rep x {sizes.reps} reps, 2 clients, c={sizes.concurrency}",
        f"orchestrator CPU per request: {per_req:.3f} ms (sum over its processes)",
        "CPU, % of one core (median of reps): "
        + ", ".join(f"{k} {100 * v:.0f}%" for k, v in cpu.items() if k not in (MACHINE, OTHER))
        + f"; other {100 * cpu.get(OTHER, 0):.0f}%, machine {100 * cpu.get(MACHINE, 0):.0f}%",
    ]
    if errors:
        notes.append(f"{len(errors)} failed or wrong requests, e.g. {errors[0]}")
    p50, p99 = p50_p99_ms(latencies)
    return Row(
        "orchestrators", config, "requests/s", "/s",
        value, lo, hi, p50, p99, notes=notes,
        details={"orchestrator_cpu_ms_per_request": per_req, "cpu_fraction_of_core": cpu},
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(scenario.main("orchestrators", __doc__, run, FULL, QUICK))
