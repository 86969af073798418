"""What durable request state costs per hop: the seed pipeline with it and without it.

Two deployments of `workers/seed.yaml` on one Redis, side by side: one as shipped
(`OMNI_DURABLE_REQUESTS` on: every state change is written with the batch that
carries its consequences), one with it off. Each traces to its own
`OMNI_TRACE_FILE`; repetitions alternate between them. Light load as in
`benchmarks.hops`: one request in flight, the next ~5 ms after the previous ended.
Hop S(k) -> S(k+1) = the orchestrator read stage k's finished output -> a worker
of stage k+1 read its input (pooled over both hops).

Ratio: hop p50 with durable state / without, same run.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from dataclasses import dataclass

from benchmarks.harness import scenario
from benchmarks.harness.procs import SEED, Deployment, RoleProc, load, start_clients
from benchmarks.harness.procs import SEED_EXPECT as EXPECT
from benchmarks.harness.procs import SEED_PROMPT as PROMPT
from benchmarks.harness.report import Row, ratio
from benchmarks.harness.stats import p50_p99_ms, percentile, spread
from benchmarks.hops import at, trace_by_request

TARGET_RATIO = 1.25
VARIANTS = {"durable": "true", "not durable": "false"}


@dataclass(frozen=True)
class Sizes:
    reps: int
    requests: int
    gap_ms: float


FULL = Sizes(reps=5, requests=300, gap_ms=5.0)
QUICK = Sizes(reps=2, requests=60, gap_ms=5.0)


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    traces = {v: ctx.log_dir / f"trace-{v.replace(' ', '-')}.log" for v in VARIANTS}
    deps = {
        v: Deployment(ctx.redis_url, SEED, "durable",
                      extra_env={"OMNI_TRACE_FILE": str(traces[v]),
                                 "OMNI_DURABLE_REQUESTS": flag}).start()
        for v, flag in VARIANTS.items()
    }  # fmt: skip
    clients: dict[str, list[RoleProc]] = {}
    request_ns: dict[str, list[int]] = defaultdict(list)
    try:
        for v, d in deps.items():
            clients[v] = start_clients(d, ctx.log_dir, 1)
            load(clients[v], d, 20, 1, "warm", PROMPT, EXPECT, sizes.gap_ms)
        for rep in range(sizes.reps):
            for v, d in deps.items():
                gc.collect()
                (res,) = load(clients[v], d, sizes.requests, 1, f"hop{rep}", PROMPT, EXPECT,
                              sizes.gap_ms)  # fmt: skip
                request_ns[v].extend(res["latencies_ns"])
    finally:
        for cs in clients.values():
            for c in cs:
                c.stop()
        for d in deps.values():
            d.stop()
    rows: list[Row] = []
    for v in VARIANTS:
        hops, per_rep = hop_samples(trace_by_request(traces[v]))
        value, lo, hi = spread([percentile(s, 50) / 1e3 for s in per_rep.values()])
        p50, p99 = p50_p99_ms(hops)
        req50, _ = p50_p99_ms(request_ns[v])
        rows.append(Row(
            "durability", v, "hop p50 (per rep)", "us", value, lo, hi, p50, p99,
            notes=[f"1 in flight, ~{sizes.gap_ms:g} ms apart, {sizes.requests} requests x "
                   f"{sizes.reps} reps; {len(hops)} hops; whole request p50 {req50:.3f} ms"],
        ))  # fmt: skip
    durable, plain = rows
    durable.baseline, durable.baseline_value = plain.config, plain.value
    durable.ratio, durable.ratio_of = ratio(durable.value, plain.value), "p50"
    durable.target = f"p50 ratio <= {TARGET_RATIO:g}x"
    durable.met = durable.ratio is not None and durable.ratio <= TARGET_RATIO
    return rows


def hop_samples(by_rid: dict[str, dict[tuple[str, int | None], list[int]]]) -> tuple[
    list[int], dict[str, list[int]]
]:  # fmt: skip
    """Every hop (ns), and per repetition (the request id's tag)."""
    hops: list[int] = []
    per_rep: dict[str, list[int]] = defaultdict(list)
    for rid, st in by_rid.items():
        for k in (0, 1):
            out, read = at(st, "output_read", k), at(st, "input_read", k + 1)
            if out is not None and read is not None:
                hops.append(read - out)
                per_rep[rid.split("c0-")[0]].append(read - out)
    return hops, per_rep


if __name__ == "__main__":
    raise SystemExit(scenario.main("durability", __doc__, run, FULL, QUICK))
