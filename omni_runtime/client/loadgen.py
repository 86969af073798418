"""`omni-runtime bench`: load a running pipeline and report requests/s and latency."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from omni_runtime.client.client import OmniClient
from omni_runtime.observe.stats import percentile
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.settings import Settings


@dataclass(slots=True)
class LoadResult:
    """What a load run measured; `str()` is the report `bench` prints."""

    requests: int
    concurrency: int
    errors: int = 0
    """Requests that ended with an error output."""
    wall_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    first_ms: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.errors == 0

    def __str__(self) -> str:
        lat, first = self.latencies_ms, self.first_ms
        rate = self.requests / self.wall_s if self.wall_s > 0 else 0.0
        return (
            f"{self.requests} requests, concurrency {self.concurrency}, {self.errors} errors, "
            f"{self.wall_s:.2f} s\n"
            f"throughput  {rate:,.{0 if rate >= 100 else 2}f} requests/s\n"
            f"latency     p50 {percentile(lat, 50):.2f} ms  p99 {percentile(lat, 99):.2f} ms\n"
            f"first out   p50 {percentile(first, 50):.2f} ms  p99 {percentile(first, 99):.2f} ms"
        )


async def run_load(
    settings: Settings, pipeline: PipelineConfig, n_requests: int, concurrency: int, prompt: str
) -> LoadResult:
    result = LoadResult(n_requests, concurrency)
    async with OmniClient(settings) as client:
        await client.wait_ready(list(range(pipeline.last_stage + 1)))
        slots = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with slots:
                t0 = time.perf_counter()
                first = None
                failed = False
                async for out in client.generate(prompt):
                    first = first or time.perf_counter()
                    failed |= out.error is not None
                result.errors += failed
                result.latencies_ms.append((time.perf_counter() - t0) * 1000)
                result.first_ms.append(((first or t0) - t0) * 1000)

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n_requests)))
        result.wall_s = time.perf_counter() - start
    return result
