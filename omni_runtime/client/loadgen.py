"""`omni-runtime bench`: load a running pipeline and report requests/s and latency.

Where the pipeline file says which stage is text and which is audio (`outputs`), the
report also gives the time to first text and to first audio, and how the audio would
play: the share of requests with no gap over 100 ms (`playback`), what a voice
pipeline's users hear.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.client.client import OmniClient
from omni_runtime.client.playback import AUDIBLE_GAP_S, Continuity, Playback, audio_seconds
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
    first_error: str | None = None
    wall_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    first_ms: list[float] = field(default_factory=list)
    first_text_ms: list[float] = field(default_factory=list)
    first_audio_ms: list[float] = field(default_factory=list)
    playbacks: list[Playback] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.errors == 0

    def __str__(self) -> str:
        rate = self.requests / self.wall_s if self.wall_s > 0 else 0.0
        lines = [
            f"{self.requests} requests, concurrency {self.concurrency}, {self.errors} errors, "
            f"{self.wall_s:.2f} s",
            f"throughput  {rate:,.{0 if rate >= 100 else 2}f} requests/s",
            _spread("latency", self.latencies_ms),
            _spread("first out", self.first_ms),
        ]
        if self.first_text_ms:
            lines.append(_spread("first text", self.first_text_ms))
        if self.first_audio_ms:
            lines.append(_spread("first audio", self.first_audio_ms))
            heard = Continuity.of(self.playbacks)
            lines.append(
                f"continuity  {100 * heard.continuous_share:.1f}% of {heard.requests} with no gap "
                f"over {AUDIBLE_GAP_S * 1000:.0f} ms; worst gap p50 "
                f"{heard.worst_gap_p50_s * 1000:.2f} ms  p99 {heard.worst_gap_p99_s * 1000:.2f} ms"
            )
        if self.first_error is not None:
            lines.append(f"first error {self.first_error}")
        return "\n".join(lines)


def _spread(name: str, values_ms: list[float]) -> str:
    p50, p99 = percentile(values_ms, 50), percentile(values_ms, 99)
    return f"{name:<11} p50 {p50:.2f} ms  p99 {p99:.2f} ms"


async def run_load(
    settings: Settings, pipeline: PipelineConfig, n_requests: int, concurrency: int, prompt: Any
) -> LoadResult:
    result = LoadResult(n_requests, concurrency)
    outputs = pipeline.outputs
    text_stage = outputs.text_stage if outputs is not None else None
    audio_stage = outputs.audio_stage if outputs is not None else None
    async with OmniClient(settings) as client:
        await client.wait_ready(list(range(pipeline.last_stage + 1)))
        slots = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with slots:
                t0 = time.perf_counter()
                first = first_text = first_audio = None
                playback = Playback()
                async for out in client.generate(prompt):
                    now = time.perf_counter()
                    first = first or now
                    if out.error is not None:
                        result.errors += 1
                        result.first_error = result.first_error or out.error
                    elif out.stage_id == text_stage and out.data:
                        first_text = first_text or now
                    elif out.stage_id == audio_stage and outputs is not None:
                        heard = audio_seconds(out.data, outputs.sample_rate)
                        first_audio = first_audio or (now if heard else None)
                        playback.add(now, heard)
                result.latencies_ms.append((time.perf_counter() - t0) * 1000)
                result.first_ms.append(((first or t0) - t0) * 1000)
                if first_text is not None:
                    result.first_text_ms.append((first_text - t0) * 1000)
                if first_audio is not None:
                    result.first_audio_ms.append((first_audio - t0) * 1000)
                    result.playbacks.append(playback)

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n_requests)))
        result.wall_s = time.perf_counter() - start
    return result
