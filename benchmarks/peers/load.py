"""The closed loop both systems get: the same prompt, users, think times, checks and clock.

A system is a `Source`: given the prompt, an async iterator of `(stage_id, data)`
(0: a text token, 2: a float32 PCM chunk), raising on a failed request. The loop is
`benchmarks/ttfp.py`'s: C users, each waiting a random think time (uniform over two
decode steps, the same draws for every system) before its next request. Per request,
from just before the source is opened: TTFT (first token), TTFA (first audio samples),
E2E (the source ends), and what a listener hears (`omni_runtime.client.playback`). Every
request is checked (the tokens in order, the number of samples). A cell's samples go
to JSON and back, so the Ray driver process can run the same loop and hand them over.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness.stats import percentile
from benchmarks.ttfp import (
    AUDIO_STAGE,
    FRAME_SAMPLES,
    RATE,
    TEXT_STAGE,
    THINK_MAX_S,
    TOKEN_DELAY_S,
    TOKENS,
    WORDS,
)
from omni_runtime.client.playback import Continuity, Playback, audio_seconds

Source = Callable[[str], AsyncIterator[tuple[int, Any]]]
REQUEST_TIMEOUT_S = 30.0
METRICS = ("ttft", "ttfa", "e2e")
STEP = "step"
"""Per request, (last token - first token) / (TOKENS - 1): the thinker's step period as the
client sees it (20 ms of pacing plus what the system adds between steps)."""
ONE_REQUEST_S = TOKENS * TOKEN_DELAY_S + 1.0
"""About one request's length unloaded: the thinker's 50 steps, then the last token's way."""


def prompt_tokens() -> tuple[str, list[str]]:
    """`ttfp`'s prompt: 50 distinct words (~6 s of audio), and the tokens it must give."""
    tokens = [WORDS[i % len(WORDS)] + str(i // len(WORDS) or "") for i in range(TOKENS)]
    return " ".join(tokens), tokens


@dataclass
class Samples:
    """One system and mode at one concurrency: per-request figures (ms) and failures."""

    ms: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in (*METRICS, STEP)})
    errors: list[str] = field(default_factory=list)
    heard: list[Playback] = field(default_factory=list)
    wall_s: float = 0.0
    """From the first submission to the last request's end."""

    def p(self, metric: str, q: float) -> float | None:
        values = self.ms.get(metric, [])
        return percentile(values, q) if values else None

    @property
    def done(self) -> int:
        return len(self.ms["e2e"])

    @property
    def throughput(self) -> float:
        return self.done / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def continuity(self) -> Continuity:
        return Continuity.of(self.heard)

    def to_json(self) -> dict[str, Any]:
        return {
            "ms": self.ms, "errors": self.errors[:20], "error_count": len(self.errors),
            "wall_s": self.wall_s,
            "heard": [{"started_at": h.started_at, "gaps": h.gaps} for h in self.heard],
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Samples:
        errors = list(d["errors"])
        errors += ["(more)"] * (int(d.get("error_count", len(errors))) - len(errors))
        heard = [Playback(started_at=h["started_at"], gaps=list(h["gaps"])) for h in d["heard"]]
        return cls(ms=d["ms"], errors=errors, heard=heard, wall_s=float(d["wall_s"]))


async def one_request(source: Source, prompt: str, tokens: list[str], out: Samples) -> None:
    t0 = time.perf_counter()
    ttft = ttfa = None
    last_text = 0.0
    texts: list[Any] = []
    samples = 0
    heard = Playback()
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async for stage, data in source(prompt):
                now = time.perf_counter()
                if stage == TEXT_STAGE:
                    texts.append(data)
                    ttft, last_text = ttft or now, now
                elif stage == AUDIO_STAGE and len(data) > 0:
                    samples += len(data)
                    ttfa = ttfa or now
                    heard.add(now, audio_seconds(data, RATE))
    except Exception as e:  # a failed request is counted and shown, the loop goes on
        out.errors.append(f"{type(e).__name__}: {e}"[:300])
        return
    end = time.perf_counter()
    want = sum(len(t) for t in tokens) * FRAME_SAMPLES
    if texts != tokens or samples != want or ttft is None or ttfa is None:
        out.errors.append(f"{len(texts)} tokens, {samples} samples (want {want})")
        return
    for metric, t in zip(METRICS, (ttft, ttfa, end), strict=True):
        out.ms[metric].append((t - t0) * 1e3)
    out.ms[STEP].append((last_text - ttft) * 1e3 / max(1, len(tokens) - 1))
    out.heard.append(heard)


async def closed_loop(source: Source, concurrency: int, n: int) -> Samples:
    """`n` requests from `concurrency` users, each thinking before its next request."""
    prompt, tokens = prompt_tokens()
    out, remaining = Samples(), [n]

    async def user(think: random.Random) -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            await asyncio.sleep(think.uniform(0.0, THINK_MAX_S))
            await one_request(source, prompt, tokens, out)

    t0 = time.perf_counter()
    await asyncio.gather(*(user(random.Random(f"{concurrency}-{i}")) for i in range(concurrency)))
    out.wall_s = time.perf_counter() - t0
    return out
