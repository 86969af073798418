"""ChunkAdapter hand-off in one process vs raw SET+GETDEL round trips (same run, interleaved).

Sender adapter (stage 0) -> receiver adapter (stage 1), 4 KiB `bytes` chunks, over
`RedisConnector` (a real redis-server) and `MemoryConnector`, with 1 registered
request and with 1,000 (999 idle ones registered by `load_async` that never get
data). The main thread plays both stages' scheduler: `save_async`, then `poll_ready`
in a tight loop. Sender and receiver share one interpreter lock here; between two
processes see `handoff.py`.

- throughput: `n` chunks queued at once; chunks/s from the first `save_async` to
  the last chunk seen in `poll_ready` (a deadline caps slow configurations);
- hand-off p50/p99: one chunk in flight, the next sent 2 ms after the previous was seen.

Baseline: one redis-py client doing `SET key <4 KiB> EX 300` + `GETDEL key`, pairs/s.
Ratio: adapter chunks/s / raw pairs/s (the Redis rows; memory rows have no baseline).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from benchmarks.harness import scenario
from benchmarks.harness.redis import delete_keys
from benchmarks.harness.report import Row, ratio
from benchmarks.harness.stats import p50_p99_ms, spread
from omni_runtime import ChunkAdapter
from omni_runtime.chunks import MemoryConnector, RedisConnector

PAYLOAD = os.urandom(4096)
TARGET_RATIO = 1.0
TARGET_P50_MS = 2.0
LATENCY_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Sizes:
    reps: int
    mem_chunks: int
    redis_chunks: int
    raw_pairs: int
    deadline_s: float
    latency_samples: int
    gap_ms: float
    idle_requests: int


FULL = Sizes(5, 20_000, 4_000, 4_000, 3.0, 300, 2.0, 999)
QUICK = Sizes(3, 2_000, 1_000, 1_000, 1.0, 60, 2.0, 999)


def _payload(seq: int) -> bytes:
    return seq.to_bytes(8, "little") + PAYLOAD[8:]


def _seq(chunk: dict[str, Any]) -> int:
    return int.from_bytes(chunk["data"][:8], "little")


@contextlib.contextmanager
def adapter_pair(connector: Any, idle: int) -> Iterator[tuple[ChunkAdapter, ChunkAdapter, str]]:
    """Sender, receiver (`idle` extra requests registered and idle), the active request id."""
    tag = uuid.uuid4().hex[:8]
    sender, receiver = ChunkAdapter(connector, stage_id=0), ChunkAdapter(connector, stage_id=1)
    try:
        for i in range(idle):
            receiver.load_async(f"{tag}-idle{i}")
        rid = f"{tag}-active"
        receiver.load_async(rid)
        time.sleep(0.01)  # receiver idle and listening, as in a running stage
        yield sender, receiver, rid
        receiver.cleanup_receiver(rid)
        sender.cancel_sender(rid)
    finally:
        sender.stop()
        receiver.stop()


def throughput(connector: Any, idle: int, n: int, deadline_s: float) -> tuple[float, bool]:
    """(chunks/s, all `n` arrived before the deadline)."""
    received = 0
    with adapter_pair(connector, idle) as (sender, receiver, rid):
        t_last = t0 = time.perf_counter_ns()
        for i in range(n):
            sender.save_async(rid, _payload(i), is_final=i == n - 1)
        end = t0 + int(deadline_s * 1e9)
        while received < n:
            got = receiver.poll_ready().get(rid, ())
            now = time.perf_counter_ns()
            if got:
                received, t_last = received + len(got), now
            elif now > end:
                break
            else:
                time.sleep(20e-6)
    return (received / ((t_last - t0) / 1e9) if received else 0.0), received == n


def handoff(connector: Any, idle: int, samples: int, gap_ms: float) -> tuple[list[int], int]:
    """(save_async -> seen in poll_ready ns, one chunk in flight; chunks never seen)."""
    lat: list[int] = []
    with adapter_pair(connector, idle) as (sender, receiver, rid):
        sent_at = 0
        for seq in range(samples):
            time.sleep(gap_ms / 1e3)
            sent_at = time.perf_counter_ns()
            sender.save_async(rid, _payload(seq), is_final=seq == samples - 1)
            while True:
                got = receiver.poll_ready().get(rid, ())
                now = time.perf_counter_ns()
                if any(_seq(c) == seq for c in got):
                    lat.append(now - sent_at)
                    break
                if now - sent_at > LATENCY_TIMEOUT_S * 1e9:
                    return lat, samples - len(lat)  # lost or stuck: stop this repetition
                time.sleep(20e-6)
    return lat, 0


def raw_pairs(client: redis.Redis, n: int, prefix: str) -> tuple[float, list[int]]:
    """One client's SET(4 KiB, EX) + GETDEL round trips: (pairs/s, per-pair ns)."""
    lat: list[int] = []
    t0 = time.perf_counter_ns()
    for i in range(n):
        s = time.perf_counter_ns()
        client.set(f"{prefix}raw{i}", PAYLOAD, ex=300)
        client.getdel(f"{prefix}raw{i}")
        lat.append(time.perf_counter_ns() - s)
    return n / ((time.perf_counter_ns() - t0) / 1e9), lat


@dataclass
class Config:
    name: str
    make: Callable[[], Any]
    idle: int
    chunks: int
    rates: list[float]
    complete: list[bool]
    lat: list[int]
    lost: int = 0


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    prefix = f"bench-adapter-{uuid.uuid4().hex[:8]}:"
    raw = redis.Redis.from_url(ctx.redis_url)
    conn = RedisConnector.from_url(ctx.redis_url, prefix=prefix)
    many = sizes.idle_requests + 1
    configs = [
        Config(f"redis, {n} registered", lambda: conn, idle, sizes.redis_chunks, [], [], [])
        for n, idle in ((1, 0), (many, sizes.idle_requests))
    ] + [
        Config(f"memory, {n} registered", MemoryConnector, idle, sizes.mem_chunks, [], [], [])
        for n, idle in ((1, 0), (many, sizes.idle_requests))
    ]
    raw_rates: list[float] = []
    raw_lat: list[int] = []
    try:
        raw_pairs(raw, 200, prefix)  # warm-up
        for _ in range(sizes.reps):
            rate, lats = raw_pairs(raw, sizes.raw_pairs, prefix)
            raw_rates.append(rate)
            raw_lat.extend(lats)
            for c in configs:
                gc.collect()
                rate, complete = throughput(c.make(), c.idle, c.chunks, sizes.deadline_s)
                c.rates.append(rate)
                c.complete.append(complete)
                gc.collect()
                lats, lost = handoff(c.make(), c.idle, sizes.latency_samples, sizes.gap_ms)
                c.lat.extend(lats)
                c.lost += lost
    finally:
        raw.close()
        conn.close()
        delete_keys(ctx.redis_url, f"{prefix}*")
    raw_value, raw_lo, raw_hi = spread(raw_rates)
    p50, p99 = p50_p99_ms(raw_lat)
    rows = [
        Row("core_adapter", "raw SET EX + GETDEL, 4 KiB, 1 client", "pairs/s", "/s", raw_value,
            raw_lo, raw_hi, p50, p99, notes=["the baseline; p50/p99 = one SET+GETDEL pair"])
    ]  # fmt: skip
    for c in configs:
        value, lo, hi = spread(c.rates)
        p50, p99 = p50_p99_ms(c.lat)
        on_redis = c.name.startswith("redis")
        r = ratio(value, raw_value) if on_redis else None
        met = p50 is not None and p50 <= TARGET_P50_MS and not c.lost
        if r is not None:
            met = met and r >= TARGET_RATIO
        notes = [
            f"{c.chunks} chunks/rep queued at once; p50/p99 = save_async -> seen in poll_ready, "
            f"one in flight, {sizes.gap_ms:g} ms apart, {len(c.lat)} samples"
        ]
        if not all(c.complete):
            notes.append(f"{c.complete.count(False)} reps hit the {sizes.deadline_s:g} s deadline")
        if c.lost:
            notes.append(f"{c.lost} hand-offs not seen within {LATENCY_TIMEOUT_S:g} s")
        rows.append(
            Row("core_adapter", c.name + ", 4 KiB", "chunks/s", "/s", value, lo, hi, p50, p99,
                baseline="raw SET+GETDEL" if on_redis else "",
                baseline_value=raw_value if on_redis else None, ratio=r,
                ratio_of="rate" if on_redis else "",
                target=(f"rate >= {TARGET_RATIO:g}x raw, " if on_redis else "")
                + f"p50 <= {TARGET_P50_MS:g} ms",
                met=met, notes=notes)
        )  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("core_adapter", __doc__, run, FULL, QUICK))
