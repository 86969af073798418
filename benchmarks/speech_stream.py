"""An agent's spoken answer on the real models: the answer written into `/v1/audio/speech/stream`
as it comes, against the same answer spoken by `/v1/audio/speech` once it is written.

`omni-runtime serve` fronting workers/voice.yaml (SmolLM2 on llama.cpp) and
workers/speak.yaml (piper), as a user runs it (embedded). For each question (distinct,
each its own seed, so both ways get the same answer), the two ways alternate:

* stream: the chat completion (`voice`, text only, streamed) goes token by token into a
  speech stream of `speak`, from the moment each token arrives;
* whole: the same completion streamed to its end, then `/v1/audio/speech` (`pcm`,
  streamed as made) with its whole text.

From the question: the first audio byte (TTFA) and the last (E2E); the speech's length;
and what a listener playing it from its first byte in real time hears
(`omni_runtime.client.playback`: a gap is silence after what came had played out).
Baseline: the whole way, same question, same run. Targets: TTFA p50 at most half the
whole way's; E2E p50 no later; every streamed answer with no gap over 100 ms.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import openai
import websockets
from openai.types.chat import ChatCompletionChunk

from benchmarks.harness import scenario
from benchmarks.harness.report import ROOT, Row, ratio
from benchmarks.harness.serve import ServeProcess
from benchmarks.harness.stats import percentile
from omni_runtime.client.playback import AUDIBLE_GAP_S, Playback

PIPELINES = f"{ROOT / 'workers' / 'voice.yaml'},{ROOT / 'workers' / 'speak.yaml'}"
PCM_BYTES_PER_S = 48_000
"""24 kHz 16-bit mono: what both endpoints send."""
TARGET_TTFA = 0.5
TARGET_E2E = 1.0
QUESTIONS = [
    "Why is the sky blue?", "What do bees make?", "Describe a rainy morning.",
    "Why do cats purr?", "What is a volcano?", "How do birds fly?", "What is the moon made of?",
    "Describe the ocean.", "Why do leaves fall?", "What is a rainbow?", "How do fish breathe?",
    "What is thunder?",
]  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    questions: int
    max_tokens: int = 96
    warmup: int = 1


FULL = Sizes(questions=12)
QUICK = Sizes(questions=4)


@dataclass
class Spoken:
    ttfa_s: float = 0.0
    e2e_s: float = 0.0
    audio_s: float = 0.0
    worst_gap_s: float = 0.0
    text: str = ""
    playback: Playback = field(default_factory=Playback)

    def heard(self, t0: float, size: int) -> None:
        now = time.monotonic()
        if not self.ttfa_s:
            self.ttfa_s = now - t0
        self.playback.add(now, size / PCM_BYTES_PER_S)
        self.audio_s += size / PCM_BYTES_PER_S
        self.e2e_s = now - t0


async def answer(
    llm: openai.AsyncOpenAI, question: str, seed: int, max_tokens: int
) -> openai.AsyncStream[ChatCompletionChunk]:
    return await llm.chat.completions.create(
        model="voice", messages=[{"role": "user", "content": question}], stream=True,
        max_tokens=max_tokens, seed=seed,
    )  # fmt: skip


async def streamed(serve: ServeProcess, question: str, seed: int, sizes: Sizes) -> Spoken:
    out = Spoken()
    url = serve.url.replace("http://", "ws://") + "/v1/audio/speech/stream?model=speak"
    async with (
        openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0) as llm,
        websockets.connect(url, max_size=None) as ws,
    ):
        t0 = time.monotonic()

        async def listen() -> None:
            async for m in ws:
                if isinstance(m, bytes):
                    out.heard(t0, len(m))
                elif json.loads(m)["type"] == "session.done":
                    return

        listening = asyncio.create_task(listen())
        await ws.send(json.dumps({"type": "session.config", "stream_audio": True}))
        async for chunk in await answer(llm, question, seed, sizes.max_tokens):
            if chunk.choices and (delta := chunk.choices[0].delta.content):
                out.text += delta
                await ws.send(json.dumps({"type": "input.text", "text": delta}))
        await ws.send(json.dumps({"type": "input.done"}))
        await asyncio.wait_for(listening, 120)
    out.worst_gap_s = out.playback.worst_gap_s
    return out


async def whole(serve: ServeProcess, question: str, seed: int, sizes: Sizes) -> Spoken:
    out = Spoken()
    async with (
        openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0) as llm,
        httpx.AsyncClient(timeout=120) as http,
    ):
        t0 = time.monotonic()
        async for chunk in await answer(llm, question, seed, sizes.max_tokens):
            if chunk.choices and (delta := chunk.choices[0].delta.content):
                out.text += delta
        body = {"model": "speak", "input": out.text, "response_format": "pcm"}
        async with http.stream("POST", f"{serve.url}/v1/audio/speech", json=body) as r:
            r.raise_for_status()
            async for data in r.aiter_bytes():
                out.heard(t0, len(data))
    out.worst_gap_s = out.playback.worst_gap_s
    return out


async def measure(ctx: scenario.Context, sizes: Sizes) -> tuple[list[Spoken], list[Spoken]]:
    with ServeProcess(ctx.log_dir / "serve.log", "--pipeline", PIPELINES) as serve:
        for k in range(sizes.warmup):
            await streamed(serve, QUESTIONS[k], k, sizes)
            await whole(serve, QUESTIONS[k], k, sizes)
        streams: list[Spoken] = []
        wholes: list[Spoken] = []
        for k in range(sizes.questions):
            question, seed = QUESTIONS[k % len(QUESTIONS)], 100 + k
            ways = (streamed, whole) if k % 2 == 0 else (whole, streamed)  # alternated
            for way in ways:
                got = await way(serve, question, seed, sizes)
                (streams if way is streamed else wholes).append(got)
        serve.check_alive()
    return streams, wholes


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    streams, wholes = asyncio.run(measure(ctx, sizes))
    same = sum(s.text == w.text for s, w in zip(streams, wholes, strict=True))
    cfg = f"{len(streams)} answers, c=1"
    rows = []
    for metric, of, target, limit in (
        ("question -> first audio", "ttfa_s", f"<= {TARGET_TTFA:g}x whole", TARGET_TTFA),
        ("question -> last audio", "e2e_s", f"<= {TARGET_E2E:g}x whole", TARGET_E2E),
    ):
        s = [1e3 * getattr(x, of) for x in streams]
        w = [1e3 * getattr(x, of) for x in wholes]
        r = ratio(percentile(s, 50), percentile(w, 50))
        rows.append(Row(
            "speech_stream", cfg, metric, "ms", percentile(s, 50), min(s), max(s),
            percentile(s, 50), percentile(s, 99), baseline="written, then /v1/audio/speech",
            baseline_value=percentile(w, 50), ratio=r, target=target,
            met=r is not None and r <= limit,
            notes=[f"whole way p99 {percentile(w, 99):.0f} ms"],
        ))  # fmt: skip
    gaps = [1e3 * s.worst_gap_s for s in streams]
    smooth = sum(g <= AUDIBLE_GAP_S * 1e3 for g in gaps) / len(gaps)
    rows.append(Row(
        "speech_stream", cfg, f"streamed answers with no gap > {AUDIBLE_GAP_S * 1e3:g} ms", "%",
        100 * smooth, baseline="whole way",
        baseline_value=100 * sum(w.worst_gap_s <= AUDIBLE_GAP_S for w in wholes) / len(wholes),
        target="100 %", met=smooth == 1.0,
        notes=[f"worst gap p50 {percentile(gaps, 50):.0f} ms, max {max(gaps):.0f} ms",
               f"speech {sum(s.audio_s for s in streams):.0f} s streamed, "
               f"{sum(w.audio_s for w in wholes):.0f} s whole; {same} of {len(streams)} "
               "answers the same text both ways"],
    ))  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("speech_stream", __doc__, run, FULL, QUICK))
