"""`omni-runtime bench`: load a running pipeline and report requests/s and latency."""

from __future__ import annotations

import asyncio
import time

from omni_runtime.client import OmniClient
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.settings import Settings
from omni_runtime.stats import percentile


async def run_load(
    settings: Settings, pipeline: PipelineConfig, n_requests: int, concurrency: int, prompt: str
) -> str:
    latencies_ms: list[float] = []
    first_ms: list[float] = []
    errors = 0
    async with OmniClient(settings) as client:
        await client.wait_ready(list(range(pipeline.last_stage + 1)))
        slots = asyncio.Semaphore(concurrency)

        async def one() -> None:
            nonlocal errors
            async with slots:
                t0 = time.perf_counter()
                first = None
                async for out in client.generate(prompt):
                    first = first or time.perf_counter()
                    errors += out.error is not None
                latencies_ms.append((time.perf_counter() - t0) * 1000)
                first_ms.append(((first or t0) - t0) * 1000)

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n_requests)))
        wall_s = time.perf_counter() - start
    return (
        f"{n_requests} requests, concurrency {concurrency}, {errors} errors, {wall_s:.2f} s\n"
        f"throughput  {n_requests / wall_s:,.0f} requests/s\n"
        f"latency     p50 {percentile(latencies_ms, 50):.2f} ms  p99 {percentile(latencies_ms, 99):.2f} ms\n"
        f"first out   p50 {percentile(first_ms, 50):.2f} ms  p99 {percentile(first_ms, 99):.2f} ms"
    )
