"""Long outputs in sequential mode: what a chunk costs the orchestrator and Redis when a
stage streams 2,000 chunks instead of 100.

`benchmarks/stages/long_outputs.yaml` (sequential, final stage 1): stage 0 streams N
chunks of S bytes, `gap_ms` apart (a decode step's pace); stage 1 gets them all once
stage 0 finished and answers with a summary the client checks (count, bytes, order).
Until then the orchestrator keeps stage 0's chunks, in memory and in the request's
durable state in Redis (`orchestrator/request_store.py`), so another orchestrator taking
the request over can still forward them. A durable state re-written whole on every
change would make a chunk cost O(N): this shows it as CPU per chunk growing with N.

Per repetition, one load of each size (alternated, so a shared machine's drift hits
both): `requests` requests at `concurrency` in flight, the same number of chunks in
every load. CPU time of the orchestrator process and of redis-server (`/proc`) over
the load, divided by the chunks it carried; the median over repetitions, [min..max].
Redis's input bytes per chunk (`INFO stats`) have rows too, without a target: they
show where the CPU goes. Latency = submit -> stage 1's answer (p50/p99 over every
request of the size).

Ratio: CPU per chunk at the long size / at the short one, same run, each process.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass
from typing import Any

import redis

from benchmarks.harness import scenario
from benchmarks.harness.cpu import OTHER, SHARED_MACHINE_FRACTION, CpuSampler
from benchmarks.harness.procs import Deployment, RoleProc, load, span, start_clients
from benchmarks.harness.redis import server_pid
from benchmarks.harness.report import ROOT, Row, ratio
from benchmarks.harness.stats import p50_p99_ms, spread

PIPELINE = ROOT / "benchmarks" / "stages" / "long_outputs.yaml"
TARGET_RATIO = 1.3
MEASURED = ("orchestrator", "redis-server")


@dataclass(frozen=True)
class Sizes:
    reps: int
    chunk_bytes: int
    gap_ms: float
    concurrency: int
    loads: tuple[tuple[int, int], ...]
    """(chunks per request, requests per load); the first is the baseline."""


FULL = Sizes(reps=6, chunk_bytes=4096, gap_ms=2.0, concurrency=4,
             loads=((100, 160), (2000, 8)))  # fmt: skip
QUICK = Sizes(reps=4, chunk_bytes=4096, gap_ms=2.0, concurrency=4,
              loads=((100, 80), (2000, 4)))  # fmt: skip


@dataclass
class Measured:
    """One size's repetitions."""

    cpu_us: dict[str, list[float]]
    """Process -> CPU per chunk (µs), one per repetition."""
    in_bytes: list[float]
    """Redis input bytes per chunk, one per repetition."""
    other: list[float]
    """CPU outside the named processes, fraction of a core, one per repetition."""
    latencies: list[int]
    errors: list[str]


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    d = Deployment(ctx.redis_url, PIPELINE, "long").start()
    clients: list[RoleProc] = []
    got = {n: Measured({}, [], [], [], []) for n, _ in sizes.loads}
    try:
        clients = start_clients(d, ctx.log_dir, 1)
        pids = {name.split("-")[0]: pid for name, pid in d.pids().items()}
        if (pid := server_pid(ctx.redis_url)) is not None:
            pids["redis-server"] = pid
        sampler = CpuSampler(pids)
        for n, _ in sizes.loads:  # warm-up as measured: Redis's memory grown once
            c = sizes.concurrency
            load(clients, d, c, c, f"warm{n}", prompt(sizes, n), expect(sizes, n))
        for rep in range(sizes.reps):
            for n, requests in sizes.loads:
                gc.collect()
                in0 = input_bytes(ctx.redis_url)
                sampler.start()
                results = load(clients, d, requests, sizes.concurrency, f"n{n}r{rep}",
                               prompt(sizes, n), expect(sizes, n))  # fmt: skip
                cpu_s = sampler.stop()
                in1 = input_bytes(ctx.redis_url)
                wall_s, done = span(results)
                m, chunks = got[n], done * n
                for name, seconds in cpu_s.items():
                    m.cpu_us.setdefault(name, []).append(1e6 * seconds / max(1, chunks))
                m.in_bytes.append((in1 - in0) / max(1, chunks))
                m.other.append(cpu_s.get(OTHER, 0.0) / wall_s)
                for res in results:
                    m.latencies.extend(res["latencies_ns"])
                    m.errors.extend(res["errors"])
    finally:
        for client in clients:
            client.stop()
        d.stop()
    return make_rows(sizes, got)


def prompt(sizes: Sizes, n: int) -> dict[str, Any]:
    return {"chunks": n, "bytes": sizes.chunk_bytes, "gap_ms": sizes.gap_ms}


def expect(sizes: Sizes, n: int) -> list[Any]:
    """The one output of each request: stage 1's summary of all N chunks, in order."""
    return [(1, {"chunks": n, "bytes": n * sizes.chunk_bytes, "in_order": True}, True)]


def input_bytes(url: str) -> int:
    """Bytes Redis has read from its clients since it started."""
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("stats")["total_net_input_bytes"])
    finally:
        client.close()


def make_rows(sizes: Sizes, got: dict[int, Measured]) -> list[Row]:
    base_n = sizes.loads[0][0]
    rows: list[Row] = []
    for n, requests in sizes.loads:
        m = got[n]
        p50, p99 = p50_p99_ms(m.latencies)
        config = f"{n:,} chunks x {sizes.chunk_bytes // 1024} KB, c={sizes.concurrency}"
        cpu = ", ".join(
            f"{k} {statistics.median(v):.0f} us" for k, v in m.cpu_us.items() if k != OTHER
        )
        notes = [
            f"{requests} requests/rep x {sizes.reps} reps, chunks {sizes.gap_ms:g} ms apart; "
            "p50/p99 = submit -> stage 1's answer",
            f"CPU per chunk (medians of reps): {cpu}",
        ]
        if max(m.other) > SHARED_MACHINE_FRACTION:
            notes.append(f"WARNING: up to {100 * max(m.other):.0f}% of a core outside the "
                         "benchmark: shared machine")  # fmt: skip
        if m.errors:
            notes.append(f"{len(m.errors)} failed or wrong requests, e.g. {m.errors[0]}")
        series = {f"{name} CPU per chunk": (m.cpu_us.get(name), "us") for name in MEASURED}
        series["Redis input per chunk"] = (m.in_bytes, "B")
        base = got[base_n]
        bases = {f"{name} CPU per chunk": base.cpu_us.get(name) for name in MEASURED}
        bases["Redis input per chunk"] = base.in_bytes
        for i, (metric, (values, unit)) in enumerate(series.items()):
            if not values:
                continue
            value, lo, hi = spread(values)
            row = Row("long_outputs", config, metric, unit, value, lo, hi, p50, p99,
                      notes=notes if i == 0 else [], details={"per_rep": values})  # fmt: skip
            if n != base_n and (base_values := bases[metric]):
                row.baseline = f"{base_n:,} chunks"
                row.baseline_value = statistics.median(base_values)
                row.ratio, row.ratio_of = ratio(value, row.baseline_value), "per chunk"
                if unit == "us":  # the bytes show why; the target is on CPU
                    row.target = f"ratio <= {TARGET_RATIO:g}x"
                    row.met = row.ratio is not None and row.ratio <= TARGET_RATIO and not m.errors
            rows.append(row)
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("long_outputs", __doc__, run, FULL, QUICK))
