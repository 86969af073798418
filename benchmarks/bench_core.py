"""Core micro-benchmarks: Orchestrator routing and ChunkAdapter hand-off (SPEC §3-4).

Each measurement is paired with a baseline taken in the same run, repetitions of the
measurement and of its baseline are interleaved (so drift and vCPU placement hit both), and
every figure is the median over the repetitions ([min..max] shown next to it).

(a) Orchestrator, in process. Three stages with a tiny in-benchmark stage double: S0 emits
    ``k`` chunks per request (the last one finished), S1 emits one finished chunk, S2 emits
    ``k`` chunks (the last one finished); ``forward_fn`` is the identity on the previous
    stage's data. 1,000 requests are added at once. A **routed output** is one
    ``StageOutput`` taken off a stage by a reader and handled by the dispatcher
    (``_handle_output``): every stage's every output, whether it is forwarded, emitted to
    the user or both; ``2k + 1`` per request. The rate counts from the first
    ``add_request`` to the last request's ``finished`` output as seen by ``next_output``.
    Baseline: a bare two-``asyncio.Queue`` hop (producer task -> q1 -> relay task -> q2 ->
    consumer) moving the same number of items. Ratio = orchestrator time per routed output
    / bare-hop time per item.

(b) ChunkAdapter, sender adapter (stage 0) -> receiver adapter (stage 1) in this process,
    4 KiB ``bytes`` payloads, over ``MemoryConnector`` and ``RedisConnector`` (real
    redis-server). The main thread plays both stages' scheduler: it calls ``save_async`` and
    polls ``poll_ready`` in a tight loop with a tiny sleep. Configurations: 1 registered
    request, and 1,000 registered requests (999 idle ones registered with ``load_async``
    that never get data, plus the active one).

    * throughput: ``n`` chunks queued with ``save_async`` at once; chunks/s from the first
      ``save_async`` to the moment the last chunk is seen in ``poll_ready`` (a deadline caps
      slow configurations; the rate is then over the chunks that did arrive).
    * hand-off latency: one chunk at a time, the next one sent ``gap`` ms after the previous
      one was seen (idle hand-off, no queueing); latency = ``save_async`` -> seen in
      ``poll_ready``, p50/p99 over all samples of all repetitions.

    Baseline: raw redis-py ``SET key <4 KiB> EX 300`` + ``GETDEL key`` round trips on one
    client, pairs/s and per-pair latency. Ratio = adapter chunks/s / raw pairs/s.

Run ``python benchmarks/bench_core.py [--quick] [--redis-url URL] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from common import (
    Row,
    Summary,
    base_parser,
    environment,
    format_table,
    percentile,
    private_redis_server,
    write_results,
)

from omni_runtime.chunks.adapter import ChunkAdapter
from omni_runtime.chunks.memory import MemoryConnector
from omni_runtime.chunks.redis import RedisConnector
from omni_runtime.core.orchestrator import Orchestrator
from omni_runtime.core.types import Connector, StageOutput

PAYLOAD_BYTES = 4096
ORCH_TARGET_RATIO = 4.0
ORCH_TARGET_RATE = 150_000.0
ADAPTER_TARGET_RATIO = 1.0
HANDOFF_TARGET_P50_MS = 2.0
LATENCY_TIMEOUT_S = 2.0
DEFAULT_JSON = Path("benchmarks/results/bench_core.json")


# --- sizes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    reps: int
    orch_requests: int
    orch_k: int
    mem_chunks: int
    redis_chunks: int
    raw_pairs: int
    throughput_deadline_s: float
    latency_samples: int
    latency_gap_ms: float
    idle_requests: int


FULL = Sizes(
    reps=5,
    orch_requests=1000,
    orch_k=8,
    mem_chunks=20_000,
    redis_chunks=4_000,
    raw_pairs=4_000,
    throughput_deadline_s=3.0,
    latency_samples=300,
    latency_gap_ms=2.0,
    idle_requests=999,
)
QUICK = Sizes(
    reps=5,
    orch_requests=1000,
    orch_k=4,
    mem_chunks=4_000,
    redis_chunks=1_000,
    raw_pairs=1_000,
    throughput_deadline_s=1.0,
    latency_samples=60,
    latency_gap_ms=2.0,
    idle_requests=999,
)


# --- (a) Orchestrator -------------------------------------------------------------------------


class BenchStage:
    """Minimal stage double: `submit` queues `behaviour(data)` outputs before it returns."""

    def __init__(self, behaviour: Callable[[Any], list[tuple[Any, bool]]]) -> None:
        self.behaviour = behaviour
        self.emitted = 0
        self._outputs: asyncio.Queue[StageOutput] = asyncio.Queue()

    async def submit(self, request_id: str, data: Any) -> None:
        for out_data, finished in self.behaviour(data):
            self._outputs.put_nowait(StageOutput(request_id, out_data, finished))
            self.emitted += 1

    async def get_output(self) -> list[StageOutput]:
        batch = [await self._outputs.get()]
        while not self._outputs.empty():
            batch.append(self._outputs.get_nowait())
        return batch


def _identity_forward(_next: int, _prompt: Any, previous: list[Any]) -> Any:
    return previous


def _bench_stages(k: int) -> list[BenchStage]:
    def s0(_prompt: Any) -> list[tuple[Any, bool]]:
        return [(i, i == k - 1) for i in range(k)]

    def s1(chunks: Any) -> list[tuple[Any, bool]]:
        return [(len(chunks), True)]

    def s2(_chunks: Any) -> list[tuple[Any, bool]]:
        return [(i, i == k - 1) for i in range(k)]

    return [BenchStage(s0), BenchStage(s1), BenchStage(s2)]


@dataclass
class OrchRun:
    elapsed_ns: int
    routed: int
    user_outputs: int
    request_latencies_ns: list[int]


async def _orchestrator_once(n_requests: int, k: int, finals: frozenset[int]) -> OrchRun:
    stages = _bench_stages(k)
    orch = Orchestrator(stages, finals, _identity_forward)
    rids = [f"r{i}" for i in range(n_requests)]
    added_at: dict[str, int] = {}
    latencies: list[int] = []
    user_outputs = 0
    async with orch:
        await asyncio.sleep(0)  # let the tasks reach their first await
        t0 = time.perf_counter_ns()
        for rid in rids:
            added_at[rid] = time.perf_counter_ns()
            await orch.add_request(rid, rid)
        done = 0
        while done < n_requests:
            out = await orch.next_output()
            user_outputs += 1
            if out.error is not None:
                raise RuntimeError(f"orchestrator error output: {out}")
            if out.finished:
                latencies.append(time.perf_counter_ns() - added_at[out.request_id])
                done += 1
        elapsed = time.perf_counter_ns() - t0
        if orch.request_states or orch.dropped_outputs:
            raise RuntimeError("orchestrator left state behind or dropped outputs")
    routed = sum(s.emitted for s in stages)
    return OrchRun(elapsed, routed, user_outputs, latencies)


async def _bare_hop_once(n_items: int) -> int:
    q1: asyncio.Queue[int] = asyncio.Queue()
    q2: asyncio.Queue[int] = asyncio.Queue()

    async def producer() -> None:
        for i in range(n_items):
            await q1.put(i)

    async def relay() -> None:
        while True:
            await q2.put(await q1.get())

    relay_task = asyncio.create_task(relay())
    await asyncio.sleep(0)
    t0 = time.perf_counter_ns()
    producer_task = asyncio.create_task(producer())
    for _ in range(n_items):
        await q2.get()
    elapsed = time.perf_counter_ns() - t0
    await producer_task
    relay_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await relay_task
    return elapsed


async def _bench_orchestrator_async(sizes: Sizes, finals: frozenset[int]) -> list[Row]:
    n, k = sizes.orch_requests, sizes.orch_k
    await _orchestrator_once(100, k, finals)  # warm-up
    await _bare_hop_once(1000)
    orch_ns_per: list[float] = []
    bare_ns_per: list[float] = []
    rates: list[float] = []
    bare_rates: list[float] = []
    req_lat: list[int] = []
    routed = user_outputs = 0
    for _ in range(sizes.reps):
        gc.collect()
        run = await _orchestrator_once(n, k, finals)
        routed, user_outputs = run.routed, run.user_outputs
        gc.collect()
        bare_ns = await _bare_hop_once(run.routed)
        orch_ns_per.append(run.elapsed_ns / run.routed)
        bare_ns_per.append(bare_ns / run.routed)
        rates.append(run.routed / (run.elapsed_ns / 1e9))
        bare_rates.append(run.routed / (bare_ns / 1e9))
        req_lat.extend(run.request_latencies_ns)
    config = f"finals={sorted(finals)} reqs={n} k={k}"
    ratio = statistics.median(orch_ns_per) / statistics.median(bare_ns_per)
    rate = Summary.of(rates)
    note = (
        f"{routed} routed outputs/rep ({2 * k + 1}/request), {user_outputs} user outputs/rep; "
        f"p50/p99 = add_request -> finished output per request"
    )
    return [
        Row(
            bench="a:orchestrator",
            config=config,
            metric="routed outputs/s",
            unit="1/s",
            value=rate,
            p50_ms=percentile(req_lat, 50) / 1e6,
            p99_ms=percentile(req_lat, 99) / 1e6,
            baseline="bare 2-queue hop items/s",
            baseline_value=statistics.median(bare_rates),
            ratio=ratio,
            target=f"ratio <= {ORCH_TARGET_RATIO:g}x and >= {ORCH_TARGET_RATE:,.0f}/s",
            met=ratio <= ORCH_TARGET_RATIO and rate.median >= ORCH_TARGET_RATE,
            notes=[
                note,
                f"orchestrator {statistics.median(orch_ns_per) / 1e3:.2f} us/routed output, "
                f"bare hop {statistics.median(bare_ns_per) / 1e3:.2f} us/item",
            ],
        )
    ]


def bench_orchestrator(sizes: Sizes) -> list[Row]:
    rows: list[Row] = []
    for finals in (frozenset({2}), frozenset({0, 2})):
        rows.extend(asyncio.run(_bench_orchestrator_async(sizes, finals)))
    return rows


# --- (b) ChunkAdapter -------------------------------------------------------------------------

ACTIVE = "active"
BASE_PAYLOAD = os.urandom(PAYLOAD_BYTES)


def _payload(seq: int) -> bytes:
    return seq.to_bytes(8, "little") + BASE_PAYLOAD[8:]


def _seq_of(chunk: dict[str, Any]) -> int:
    data: bytes = chunk["data"]
    return int.from_bytes(data[:8], "little")


def _poll_sleep() -> None:
    time.sleep(20e-6)


@contextlib.contextmanager
def _adapter_pair(connector: Connector, idle: int, tag: str) -> Iterator[tuple[ChunkAdapter, ...]]:
    """Sender (stage 0) and receiver (stage 1), `idle` extra requests registered and idle."""
    sender = ChunkAdapter(connector, stage_id=0)
    receiver = ChunkAdapter(connector, stage_id=1)
    try:
        for i in range(idle):
            receiver.load_async(f"{tag}-idle{i}")
        yield sender, receiver
    finally:
        sender.stop()
        receiver.stop()


def _adapter_throughput(
    connector: Connector, idle: int, n: int, deadline_s: float
) -> tuple[float, bool]:
    """(chunks/s sender -> receiver, all n arrived) for one active request + `idle` idle ones."""
    tag = uuid.uuid4().hex[:8]
    rid = f"{tag}-{ACTIVE}"
    payloads = [_payload(i) for i in range(n)]
    with _adapter_pair(connector, idle, tag) as (sender, receiver):
        receiver.load_async(rid)
        time.sleep(0.01)  # receiver idle and polling, as in a running stage
        received = 0
        t_last = t0 = time.perf_counter_ns()
        for i, p in enumerate(payloads):
            sender.save_async(rid, p, is_final=i == n - 1)
        end = t0 + int(deadline_s * 1e9)
        while received < n:
            ready = receiver.poll_ready()
            now = time.perf_counter_ns()
            if ready:
                received += len(ready.get(rid, ()))
                t_last = now
            elif now > end:
                break
            else:
                _poll_sleep()
        receiver.cleanup_receiver(rid)
        sender.cancel_sender(rid)
    if received == 0:
        return 0.0, False
    return received / ((t_last - t0) / 1e9), received == n


def _adapter_latency(
    connector: Connector, idle: int, samples: int, gap_ms: float
) -> tuple[list[int], int]:
    """save_async -> seen in poll_ready, one chunk in flight at a time; (latencies, timeouts)."""
    tag = uuid.uuid4().hex[:8]
    rid = f"{tag}-{ACTIVE}"
    gap_ns = int(gap_ms * 1e6)
    lat: list[int] = []
    timeouts = 0
    with _adapter_pair(connector, idle, tag) as (sender, receiver):
        receiver.load_async(rid)
        time.sleep(0.01)
        sent_at: dict[int, int] = {}
        seq = 0
        in_flight = False
        next_send = time.perf_counter_ns()
        while len(lat) + timeouts < samples:
            now = time.perf_counter_ns()
            if not in_flight and now >= next_send:
                p = _payload(seq)
                final = seq == samples - 1
                sent_at[seq] = time.perf_counter_ns()
                sender.save_async(rid, p, is_final=final)
                in_flight = True
            ready = receiver.poll_ready()
            seen = time.perf_counter_ns()
            for chunk in ready.get(rid, ()):
                lat.append(seen - sent_at.pop(_seq_of(chunk)))
                in_flight = False
                seq += 1
                next_send = seen + gap_ns
            if in_flight and seen - sent_at[seq] > LATENCY_TIMEOUT_S * 1e9:
                timeouts += 1
                break  # the adapter lost a chunk or is stuck; stop this repetition
            _poll_sleep()
        receiver.cleanup_receiver(rid)
        sender.cancel_sender(rid)
    return lat, timeouts


def _raw_pairs(client: redis.Redis, n: int, prefix: str) -> tuple[float, list[int]]:
    """Single-client SET(4 KiB, EX)+GETDEL round trips: (pairs/s, per-pair latencies ns)."""
    lat: list[int] = []
    t0 = time.perf_counter_ns()
    for i in range(n):
        key = f"{prefix}raw_{i}"
        s = time.perf_counter_ns()
        client.set(key, BASE_PAYLOAD, ex=300)
        client.getdel(key)
        lat.append(time.perf_counter_ns() - s)
    elapsed = time.perf_counter_ns() - t0
    return n / (elapsed / 1e9), lat


@dataclass
class AdapterConfig:
    name: str
    make: Callable[[], Connector]
    idle: int
    chunks: int


def bench_adapter(sizes: Sizes, redis_url: str | None) -> list[Row]:
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    configs = [
        AdapterConfig("memory, 1 registered", MemoryConnector, 0, sizes.mem_chunks),
        AdapterConfig(
            f"memory, {sizes.idle_requests + 1} registered",
            MemoryConnector,
            sizes.idle_requests,
            sizes.mem_chunks,
        ),
    ]
    raw_client: redis.Redis | None = None
    redis_conn: RedisConnector | None = None
    if redis_url is not None:
        raw_client = redis.Redis.from_url(redis_url)
        redis_conn = RedisConnector.from_url(redis_url, prefix=prefix)
        rc = redis_conn

        def make_redis() -> Connector:
            return rc

        configs += [
            AdapterConfig("redis, 1 registered", make_redis, 0, sizes.redis_chunks),
            AdapterConfig(
                f"redis, {sizes.idle_requests + 1} registered",
                make_redis,
                sizes.idle_requests,
                sizes.redis_chunks,
            ),
        ]
    thr: dict[str, list[tuple[float, bool]]] = {c.name: [] for c in configs}
    lat: dict[str, list[int]] = {c.name: [] for c in configs}
    timeouts: dict[str, int] = {c.name: 0 for c in configs}
    raw_rates: list[float] = []
    raw_lat: list[int] = []
    try:
        if raw_client is not None:
            _raw_pairs(raw_client, 200, prefix)  # warm-up
        for _ in range(sizes.reps):
            if raw_client is not None:
                rate, lats = _raw_pairs(raw_client, sizes.raw_pairs, prefix)
                raw_rates.append(rate)
                raw_lat.extend(lats)
            for c in configs:
                gc.collect()
                thr[c.name].append(
                    _adapter_throughput(c.make(), c.idle, c.chunks, sizes.throughput_deadline_s)
                )
                gc.collect()
                ls, tos = _adapter_latency(
                    c.make(), c.idle, sizes.latency_samples, sizes.latency_gap_ms
                )
                lat[c.name].extend(ls)
                timeouts[c.name] += tos
    finally:
        if raw_client is not None:
            with contextlib.suppress(redis.RedisError):
                for key in raw_client.scan_iter(match=f"{prefix}*", count=1000):
                    raw_client.unlink(key)
            raw_client.close()
        if redis_conn is not None:
            redis_conn.close()

    rows: list[Row] = []
    raw_med = statistics.median(raw_rates) if raw_rates else None
    if raw_rates:
        rows.append(
            Row(
                bench="b:raw redis",
                config="1 client, SET EX + GETDEL, 4 KiB",
                metric="pairs/s",
                unit="1/s",
                value=Summary.of(raw_rates),
                p50_ms=percentile(raw_lat, 50) / 1e6,
                p99_ms=percentile(raw_lat, 99) / 1e6,
                notes=["p50/p99 = one SET+GETDEL pair"],
            )
        )
    for c in configs:
        is_redis = c.name.startswith("redis")
        thr_sum = Summary.of([r for r, _ in thr[c.name]])
        truncated = sum(1 for _, complete in thr[c.name] if not complete)
        ratio = thr_sum.median / raw_med if raw_med else None
        notes = [
            f"{c.chunks} chunks/rep queued at once (deadline {sizes.throughput_deadline_s:g} s)",
            f"p50/p99 = save_async -> seen in poll_ready, one in flight, "
            f"{sizes.latency_gap_ms:g} ms gap, {len(lat[c.name])} samples",
        ]
        if truncated:
            notes.append(
                f"throughput: {truncated}/{len(thr[c.name])} reps hit the deadline before all "
                "chunks arrived (rate over the chunks that did)"
            )
        if timeouts[c.name]:
            notes.append(f"{timeouts[c.name]} hand-off(s) not seen within {LATENCY_TIMEOUT_S} s")
        samples = lat[c.name] or [0]
        p50 = percentile(samples, 50) / 1e6
        met: bool | None = p50 <= HANDOFF_TARGET_P50_MS and not timeouts[c.name]
        target = f"p50 <= {HANDOFF_TARGET_P50_MS:g} ms"
        if is_redis and ratio is not None:
            target = f"ratio >= {ADAPTER_TARGET_RATIO:g}x, " + target
            met = bool(met) and ratio >= ADAPTER_TARGET_RATIO
        rows.append(
            Row(
                bench="b:chunk adapter",
                config=c.name,
                metric="chunks/s",
                unit="1/s",
                value=thr_sum,
                p50_ms=p50,
                p99_ms=percentile(samples, 99) / 1e6,
                baseline="raw SET+GETDEL pairs/s" if raw_med else "",
                baseline_value=raw_med,
                ratio=ratio,
                target=target,
                met=met,
                notes=notes,
            )
        )
    return rows


# --- output -----------------------------------------------------------------------------------


def _fmt_rate(x: float, _unit: str) -> str:
    return f"{x / 1e3:,.1f}k" if x >= 1e3 else f"{x:,.1f}"


def _fmt_baseline(x: float, _unit: str) -> str:
    return f"{_fmt_rate(x, _unit)}/s"


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = base_parser(
        __doc__,
        DEFAULT_JSON,
        redis_help="Redis to use (default: start a private redis-server if on PATH, else skip Redis)",
        quick_help="smaller sizes for a smoke run",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace, redis_url: str | None, skipped: str | None) -> dict[str, Any]:
    sizes = QUICK if args.quick else FULL
    started = time.perf_counter()
    rows = bench_orchestrator(sizes)
    rows += bench_adapter(sizes, redis_url)
    elapsed = time.perf_counter() - started
    print(format_table(rows, _fmt_rate, _fmt_baseline))
    if skipped:
        print(f"  NOTE: {skipped}")
    print(f"\ntotal {elapsed:.1f} s ({'quick' if args.quick else 'full'})")
    return {
        "mode": "quick" if args.quick else "full",
        "sizes": asdict(sizes),
        "environment": environment(redis_url, switchinterval_s=sys.getswitchinterval()),
        "redis_skipped": skipped,
        "elapsed_s": elapsed,
        "rows": [asdict(r) for r in rows],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        skipped: str | None = None
        url: str | None = args.redis_url
        if url is None:
            url = stack.enter_context(private_redis_server())
            if url is None:
                skipped = "redis-server not on PATH and no --redis-url: Redis rows skipped"
        result = run(args, url, skipped)
    write_results(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
