"""Chunk hand-off between two processes over Redis vs raw RPUSH -> BLPOP, same run.

No pipeline runs. A sender process calls `ChunkAdapter.save_async` every U(2, 4) ms
with a CLOCK_MONOTONIC stamp in a talker-sized payload; the receiver process runs
`ChunkAdapter(on_ready=event.set)` and a scheduler thread that sleeps on the event,
calls `poll_ready` and records now - stamp (both on `RedisConnector`, as in a
worker). Baselines with the same payload (`omni_runtime.codec`) and pacing: raw
`RPUSH -> BLPOP` (the payload in the list) and raw `SET+RPUSH -> BLPOP -> GET` (the
adapter's own Redis round trips, no threads between). The first chunks are not
counted. Ratio: p50 / raw RPUSH -> BLPOP p50. Last, the adapter again on a private
3-master Redis Cluster (`RedisCluster`), its ratio against the single server's
adapter p50 of the same run.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from benchmarks.harness import scenario
from benchmarks.harness.procs import RoleProc, role_env
from benchmarks.harness.redis import delete_keys
from benchmarks.harness.report import Row, ratio
from benchmarks.harness.stats import percentile
from omni_runtime.launcher import RedisCluster

KINDS = {
    "raw_blpop": "raw RPUSH -> BLPOP",
    "raw_set_blpop_get": "raw SET+RPUSH -> BLPOP -> GET",
    "adapter": "ChunkAdapter, save_async -> poll_ready",
}
TARGET_P50_MS = 0.5
TARGET_P99_MS = 1.5


@dataclass(frozen=True)
class Sizes:
    chunks: int
    warmup: int


FULL = Sizes(chunks=1000, warmup=50)
QUICK = Sizes(chunks=200, warmup=20)


def once(ctx: scenario.Context, kind: str, sizes: Sizes) -> tuple[list[float], int]:
    """(latencies in ms, chunks never received) of one sender -> receiver run."""
    prefix, rid = f"bench-handoff-{uuid.uuid4().hex[:8]}:", f"h{uuid.uuid4().hex[:8]}"
    args = [kind, "--prefix", prefix, "--rid", rid, "-n", str(sizes.chunks)]
    env = role_env(ctx.redis_url)
    timeout_s = sizes.chunks * 0.012 + 40
    receiver = RoleProc(f"recv-{kind}", "handoff", ["recv", *args, "--warmup", str(sizes.warmup)],
                        env, ctx.log_dir)  # fmt: skip
    sender: RoleProc | None = None
    try:
        receiver.recv(60)
        sender = RoleProc(f"send-{kind}", "handoff", ["send", *args], env, ctx.log_dir)
        result = receiver.recv(timeout_s)
    finally:
        if sender is not None:
            sender.stop(10)
        receiver.stop(10)
        delete_keys(ctx.redis_url, f"{prefix}*")
    return [x / 1e6 for x in result["lat_ns"]], int(result["missing"])


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    results = {kind: once(ctx, kind, sizes) for kind in KINDS}
    with RedisCluster() as cluster:
        on_cluster = once(replace(ctx, redis_url=cluster.url), "adapter", sizes)
    base = percentile(results["raw_blpop"][0], 50)
    rows = []
    for kind, (lat, missing) in results.items():
        p50, p99 = percentile(lat, 50), percentile(lat, 99)
        is_adapter = kind == "adapter"
        row = Row(
            "handoff", KINDS[kind], "one-way p50", "ms", p50, None, None, p50, p99,
            notes=[f"{len(lat)} chunks counted (first {sizes.warmup} not), {missing} missing, "
                   f"p90 {percentile(lat, 90):.3f} ms, max {max(lat, default=float('nan')):.3f} ms"],
        )  # fmt: skip
        if kind != "raw_blpop":
            row.baseline, row.baseline_value = "raw RPUSH->BLPOP", base
            row.ratio, row.ratio_of = ratio(p50, base), "p50"
        if is_adapter:
            row.target = f"p50 <= {TARGET_P50_MS:g} ms, p99 <= {TARGET_P99_MS:g} ms"
            row.met = p50 <= TARGET_P50_MS and p99 <= TARGET_P99_MS and not missing
        rows.append(row)
    lat, missing = on_cluster
    p50, single = percentile(lat, 50), percentile(results["adapter"][0], 50)
    rows.append(
        Row("handoff", "ChunkAdapter on a 3-master Redis Cluster", "one-way p50", "ms", p50,
            None, None, p50, percentile(lat, 99), baseline="ChunkAdapter, one redis-server",
            baseline_value=single, ratio=ratio(p50, single), ratio_of="p50",
            notes=[f"{len(lat)} chunks counted, {missing} missing"])
    )  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("handoff", __doc__, run, FULL, QUICK))
