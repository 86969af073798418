"""Chunk hand-off between two processes over Redis vs raw RPUSH -> BLPOP, same run.

No pipeline runs. A sender process calls `ChunkAdapter.save_async` every U(2, 4) ms
with a CLOCK_MONOTONIC stamp in a talker-sized payload; the receiver process runs
`ChunkAdapter(on_ready=event.set)` and a scheduler thread that sleeps on the event,
calls `poll_ready` and records now - stamp (both on `RedisConnector`, as in a
worker). Baselines with the same payload (`omni_runtime.wire.codec`) and pacing: raw
`RPUSH -> BLPOP` (the payload in the list) and raw `SET+RPUSH -> BLPOP -> GET` (the
adapter's own Redis round trips, no threads between), and raw RPUSH -> BLPOP through the
two thread hand-offs SPEC §4 puts on the path (the caller wakes a sending thread, the
reading thread wakes the scheduler; no other work): the floor of any conforming
adapter on this machine, whose ratio to raw shows what the wakes alone cost. The
adapter is judged against that floor. The first chunks are not counted. The kinds run
in interleaved rounds (raw, SET+GET, two threads, adapter, raw, ...), so a load that
comes and goes on the machine falls on each alike. Ratios: p50 / raw RPUSH -> BLPOP p50
and p99 / its p99; the adapter's against the two-thread floor's, target both <= 1.15x
(its ratios to raw in the notes). Commands per chunk:
the server's `INFO commandstats` calls over a run / chunks sent. Last, the adapter
again on a private 3-master Redis Cluster (`RedisCluster`), its ratio against the
single server's adapter p50 of the same run.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, replace

import redis

from benchmarks.harness import scenario
from benchmarks.harness.procs import RoleProc, role_env
from benchmarks.harness.redis import delete_keys
from benchmarks.harness.report import Row, ratio
from benchmarks.harness.stats import percentile
from omni_runtime.local.launcher import RedisCluster

KINDS = {
    "raw_blpop": "raw RPUSH -> BLPOP",
    "raw_set_blpop_get": "raw SET+RPUSH -> BLPOP -> GET",
    "raw_threads": "raw RPUSH -> BLPOP, two thread hand-offs",
    "adapter": "ChunkAdapter, save_async -> poll_ready",
}
TARGET_RATIO = 1.15
"""p50 and p99 of the adapter against the two-thread floor's, same run."""


@dataclass(frozen=True)
class Sizes:
    chunks: int
    warmup: int
    rounds: int


FULL = Sizes(chunks=500, warmup=30, rounds=3)
QUICK = Sizes(chunks=150, warmup=20, rounds=2)


def commands(url: str) -> int | None:
    """Commands the server has run so far (None on a cluster: one node's count is no total)."""
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
        return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()


def once(ctx: scenario.Context, kind: str, sizes: Sizes) -> tuple[list[float], int, float | None]:
    """(latencies in ms, chunks never received, commands per chunk) of one run."""
    prefix, rid = f"bench-handoff-{uuid.uuid4().hex[:8]}:", f"h{uuid.uuid4().hex[:8]}"
    args = [kind, "--prefix", prefix, "--rid", rid, "-n", str(sizes.chunks)]
    env = role_env(ctx.redis_url)
    timeout_s = sizes.chunks * 0.012 + 40
    receiver = RoleProc(f"recv-{kind}", "handoff", ["recv", *args, "--warmup", str(sizes.warmup)],
                        env, ctx.log_dir)  # fmt: skip
    sender: RoleProc | None = None
    before = commands(ctx.redis_url)
    try:
        receiver.recv(60)
        sender = RoleProc(f"send-{kind}", "handoff", ["send", *args], env, ctx.log_dir)
        result = receiver.recv(timeout_s)
    finally:
        if sender is not None:
            sender.stop(10)
        receiver.stop(10)
        after = commands(ctx.redis_url)
        delete_keys(ctx.redis_url, f"{prefix}*")
    per_chunk = None if before is None or after is None else (after - before) / sizes.chunks
    return [x / 1e6 for x in result["lat_ns"]], int(result["missing"]), per_chunk


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    results: dict[str, tuple[list[float], int, list[float]]] = {k: ([], 0, []) for k in KINDS}
    for _ in range(sizes.rounds):
        for kind in KINDS:
            lat, missing, per_chunk = once(ctx, kind, sizes)
            pooled, lost, cmds = results[kind]
            cmds += [per_chunk] if per_chunk is not None else []
            results[kind] = (pooled + lat, lost + missing, cmds)
    with RedisCluster() as cluster:
        on_cluster = once(replace(ctx, redis_url=cluster.url), "adapter", sizes)
    base50, base99 = (percentile(results["raw_blpop"][0], q) for q in (50, 99))
    rows = []
    for kind, (lat, missing, cmds) in results.items():
        p50, p99 = percentile(lat, 50), percentile(lat, 99)
        cmd_note = f"{sum(cmds) / len(cmds):.2f} Redis commands per chunk" if cmds else ""
        row = Row(
            "handoff", KINDS[kind], "one-way p50", "ms", p50, None, None, p50, p99,
            notes=[f"{len(lat)} chunks counted ({sizes.rounds} rounds, first {sizes.warmup} of "
                   f"each not), {missing} missing, p90 {percentile(lat, 90):.3f} ms, "
                   f"max {max(lat, default=float('nan')):.3f} ms; {cmd_note}"],
            details={"commands_per_chunk": cmds},
        )  # fmt: skip
        if kind != "raw_blpop":
            r50, r99 = ratio(p50, base50), ratio(p99, base99)
            row.baseline, row.baseline_value = "raw RPUSH->BLPOP", base50
            row.ratio, row.ratio_of = r50, "p50"
            row.notes.append(f"p99 {p99:.3f} ms vs raw {base99:.3f} ms: {r99 or float('nan'):.2f}x")
            row.details["p99_ratio"] = r99
            if kind == "adapter":
                floor50, floor99 = (percentile(results["raw_threads"][0], q) for q in (50, 99))
                f50, f99 = ratio(p50, floor50), ratio(p99, floor99)
                row.notes.append(f"against raw: p50 {r50 or float('nan'):.2f}x; load average "
                                 f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
                row.notes.append(f"p99 {p99:.3f} ms vs the two-thread floor's {floor99:.3f} ms: "
                                 f"{f99 or float('nan'):.2f}x")  # fmt: skip
                row.details["floor_ratio"] = {"p50": f50, "p99": f99}
                row.baseline, row.baseline_value = "two-thread floor", floor50
                row.ratio = f50
                row.target = f"p50 and p99 <= {TARGET_RATIO:g}x the floor"
                ok = f50 is not None and f99 is not None and max(f50, f99) <= TARGET_RATIO
                row.met = ok and not missing
        rows.append(row)
    lat, missing, _cmds = on_cluster
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
