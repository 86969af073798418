"""In-process Orchestrator routing vs a bare two-queue asyncio hop (same run, interleaved).

Three stages with a stage double: S0 emits `k` outputs per request (the last one
finished), S1 one, S2 `k`; `forward_fn` is the identity. 1,000 requests are added at
once. A routed output is one `StageOutput` taken off a stage and handled by the
orchestrator (forwarded, emitted to the user, or both): `2k + 1` per request.
Rate: routed outputs from the first `add_request` to the last finished output.
Baseline: producer task -> queue -> relay task -> queue -> consumer moving as many
items. Ratio: orchestrator time per routed output / bare-hop time per item.
Per-request p50/p99: `add_request` -> its finished output.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import scenario
from benchmarks.harness.report import Row
from benchmarks.harness.stats import p50_p99_ms, spread
from omni_runtime import Orchestrator, StageOutput

TARGET_RATIO = 4.0
TARGET_RATE = 150_000.0


@dataclass(frozen=True)
class Sizes:
    reps: int
    requests: int
    k: int


FULL = Sizes(reps=5, requests=1000, k=8)
QUICK = Sizes(reps=3, requests=1000, k=4)


class BenchStage:
    """Stage double: `submit` queues `behaviour(data)` outputs before it returns."""

    def __init__(self, behaviour: Callable[[Any], list[tuple[Any, bool]]]) -> None:
        self.behaviour = behaviour
        self.emitted = 0
        self._outputs: asyncio.Queue[StageOutput] = asyncio.Queue()

    async def submit(
        self, request_id: str, data: Any, params: dict[str, Any] | None = None
    ) -> None:
        for out_data, finished in self.behaviour(data):
            self._outputs.put_nowait(StageOutput(request_id, out_data, finished))
            self.emitted += 1

    async def get_output(self) -> list[StageOutput]:
        batch = [await self._outputs.get()]
        while not self._outputs.empty():
            batch.append(self._outputs.get_nowait())
        return batch


def _stages(k: int) -> list[BenchStage]:
    def many(_data: Any) -> list[tuple[Any, bool]]:
        return [(i, i == k - 1) for i in range(k)]

    return [BenchStage(many), BenchStage(lambda chunks: [(len(chunks), True)]), BenchStage(many)]


def _identity_forward(_next: int, _prompt: Any, previous: list[Any]) -> Any:
    return previous


async def orchestrator_once(n: int, k: int, finals: frozenset[int]) -> tuple[int, int, list[int]]:
    """(elapsed ns, routed outputs, per-request latencies ns) for `n` requests added at once."""
    stages = _stages(k)
    orch = Orchestrator(stages, finals, _identity_forward)
    added_at: dict[str, int] = {}
    latencies: list[int] = []
    async with orch:
        await asyncio.sleep(0)  # let the tasks reach their first await
        t0 = time.perf_counter_ns()
        for i in range(n):
            rid = f"r{i}"
            added_at[rid] = time.perf_counter_ns()
            await orch.add_request(rid, rid)
        while len(latencies) < n:
            out = await orch.next_output()
            if out.error is not None:
                raise RuntimeError(f"orchestrator error output: {out}")
            if out.finished:
                latencies.append(time.perf_counter_ns() - added_at[out.request_id])
        elapsed = time.perf_counter_ns() - t0
        if orch.request_states or orch.dropped_outputs:
            raise RuntimeError("orchestrator left state behind or dropped outputs")
    return elapsed, sum(s.emitted for s in stages), latencies


async def bare_hop_once(n_items: int) -> int:
    """ns to move `n_items` through producer -> q1 -> relay -> q2 -> consumer."""
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


async def measure(sizes: Sizes, finals: frozenset[int]) -> Row:
    await orchestrator_once(100, sizes.k, finals)  # warm-up
    await bare_hop_once(1000)
    orch_per, bare_per, rates, bare_rates = [], [], [], []
    latencies: list[int] = []
    routed = 0
    for _ in range(sizes.reps):
        gc.collect()
        elapsed, routed, lat = await orchestrator_once(sizes.requests, sizes.k, finals)
        gc.collect()
        bare = await bare_hop_once(routed)
        orch_per.append(elapsed / routed)
        bare_per.append(bare / routed)
        rates.append(routed / (elapsed / 1e9))
        bare_rates.append(routed / (bare / 1e9))
        latencies.extend(lat)
    value, lo, hi = spread(rates)
    cost_ratio = statistics.median(orch_per) / statistics.median(bare_per)
    p50, p99 = p50_p99_ms(latencies)
    return Row(
        scenario="core_orchestrator",
        config=f"3 stages, finals {sorted(finals)}, {sizes.requests} requests, k={sizes.k}",
        metric="routed outputs/s",
        unit="/s",
        value=value,
        lo=lo,
        hi=hi,
        p50_ms=p50,
        p99_ms=p99,
        baseline="bare 2-queue hop",
        baseline_value=statistics.median(bare_rates),
        ratio=cost_ratio,
        ratio_of="cost per item",
        target=f"cost ratio <= {TARGET_RATIO:g}x, >= {TARGET_RATE / 1e3:,.0f}k/s",
        met=cost_ratio <= TARGET_RATIO and value >= TARGET_RATE,
        notes=[
            f"{routed} routed outputs/rep ({2 * sizes.k + 1}/request), {sizes.reps} reps; "
            "p50/p99 = add_request -> finished output",
            f"orchestrator {statistics.median(orch_per) / 1e3:.2f} us/routed output, "
            f"bare hop {statistics.median(bare_per) / 1e3:.2f} us/item",
        ],
    )


def run(_ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    return [asyncio.run(measure(sizes, frozenset(f))) for f in ({2}, {0, 2})]


if __name__ == "__main__":
    raise SystemExit(scenario.main("core_orchestrator", __doc__, run, FULL, QUICK))
