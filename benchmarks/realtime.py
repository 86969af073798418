"""`/v1/realtime` on the synthetic demo: barge-in latency, and many sessions at once.

`workers/omni.yaml` in streaming mode as processes, `omni-runtime serve` in front of it,
the official `openai` client's realtime connection here (events read as raw JSON, to keep
this process's share of the two cores small).

Barge-in, one session per try: a long answer (600 words: ~60 s of audio, its text made
over ~12 s) streams; once its first audio arrived, piper's speech is appended in 20 ms
chunks in real time, as a microphone sends it, with server VAD on. From the first chunk
sent ("speech start"): `input_audio_buffer.speech_started` (the VAD's own ~60 ms of
voiced frames included), `response.done` with status `cancelled`, and every stage having
dropped the request (its workers' heartbeats, `status`'s source, beating every 20 ms:
abort count up, nothing in flight; the figure is late by up to one beat). The barge-in
time is the later of the last two. Baseline: speech start to `speech_started`.

Sessions: S sessions at once, T text turns each (25 distinct words, ~2.7 s of audio),
the next turn after a think time (uniform 0-40 ms) once `response.done` came. A turn
completes when its status is `completed` and its audio has the demo's exact length;
a listener plays each turn's audio from its first delta in real time
(`omni_runtime.client.playback`): a turn "has no gap" when no delta came more than 100 ms after
the audio before it had played out. Baseline: one session alone, same turns, same run.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openai
import redis
import soxr

from benchmarks.harness import scenario
from benchmarks.harness.procs import Deployment, watched
from benchmarks.harness.report import ROOT, Row, ratio
from benchmarks.harness.serve import ServeProcess, for_deployment
from benchmarks.harness.stats import percentile
from omni_runtime.client.playback import AUDIBLE_GAP_S, Playback

OMNI = ROOT / "workers" / "omni.yaml"
KEY = "bench-key-0123456789"
RATE = 24_000
CHUNK_MS = 20
BEAT_S = 0.02
STAGES = (0, 1, 2)
LONG_TEXT = " ".join(f"word{i}" for i in range(600))
SPOKEN = "Stop, please wait a moment, I have another question for you."
_WORDS_TEXT = (
    "amber birch cedar delta ember falcon garden harbor island jasper kettle lantern meadow "
    "nickel orchid pepper quartz raven silver thistle umber velvet willow yarrow zephyr"
)
WORDS = _WORDS_TEXT.split()
TARGET_BARGE_IN_MS = 300.0
TARGET_CONTINUITY = 0.99


@dataclass(frozen=True)
class Sizes:
    barge_ins: int
    sessions: int
    turns: int


FULL = Sizes(barge_ins=50, sessions=32, turns=5)
QUICK = Sizes(barge_ins=10, sessions=8, turns=2)


def speech_chunks() -> list[str]:
    """`SPOKEN` said by piper, 24 kHz PCM16 from its first loud sample, in base64 20 ms chunks."""
    from omni_runtime.engines import piper
    from omni_runtime.stage_api import Final

    def plain(items: Any) -> list[Any]:
        return [i.data if isinstance(i, Final) else i for i in items]

    pcm = np.concatenate([np.asarray(c, np.float32) for c in plain(piper.vocoder(plain(
        piper.talker(SPOKEN))))])  # fmt: skip
    pcm = soxr.resample(pcm, 22_050, RATE).astype(np.float32)
    pcm = pcm[np.flatnonzero(np.abs(pcm) > 0.05)[0] :]
    raw = np.round(np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()
    step = RATE * 2 * CHUNK_MS // 1000
    return [base64.b64encode(raw[i : i + step]).decode() for i in range(0, len(raw), step)]


class Stages:
    """Each stage's workers' (aborted, in flight), from their heartbeats."""

    def __init__(self, d: Deployment) -> None:
        self.r = redis.Redis.from_url(d.redis_url)
        names = d.settings.names
        self.keys = {s: list(self.r.scan_iter(names.heartbeat_pattern(s))) for s in STAGES}
        assert all(self.keys.values()), f"a stage without a heartbeat: {self.keys}"

    def now(self) -> dict[int, tuple[int, int]]:
        pipe = self.r.pipeline(transaction=False)
        for keys in self.keys.values():
            for key in keys:
                pipe.get(key)
        docs = iter(pipe.execute())
        out = {}
        for s, keys in self.keys.items():
            beats = [json.loads(next(docs) or "{}") for _ in keys]
            out[s] = (
                sum(b.get("aborted", 0) for b in beats),
                sum(b.get("in_flight", 0) for b in beats),
            )
        return out

    def wait_dropped(self, before: dict[int, tuple[int, int]], deadline_s: float) -> float:
        """perf_counter when every stage has aborted one more request and holds none."""
        end = time.perf_counter() + deadline_s
        while time.perf_counter() < end:
            now = self.now()
            if all(now[s][0] > before[s][0] and now[s][1] == 0 for s in STAGES):
                return time.perf_counter()
            time.sleep(0.002)
        raise TimeoutError(f"a stage still had the request after {deadline_s:g} s: {self.now()}")


def client(serve: ServeProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key=KEY, max_retries=0)


async def next_event(conn: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    ev: dict[str, Any] = json.loads(await asyncio.wait_for(conn.recv_bytes(), timeout_s))
    return ev


def text_item(text: str) -> Any:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


@dataclass
class BargeIn:
    vad_ms: float
    done_ms: float
    dropped_ms: float

    @property
    def total_ms(self) -> float:
        return max(self.done_ms, self.dropped_ms)


async def barge_in(serve: ServeProcess, stages: Stages, chunks: list[str]) -> BargeIn:
    async with client(serve).realtime.connect(model="omni") as conn:
        vad: Any = {"type": "server_vad", "create_response": False}
        await conn.session.update(session={
            "type": "realtime", "output_modalities": ["audio"],
            "audio": {"input": {"turn_detection": vad}},
        })  # fmt: skip
        await conn.conversation.item.create(item=text_item(LONG_TEXT))
        before = await asyncio.to_thread(stages.now)
        await conn.response.create()
        while (await next_event(conn))["type"] != "response.output_audio.delta":
            pass

        async def speak() -> None:  # a microphone: one 20 ms chunk every 20 ms
            for i, chunk in enumerate(chunks):
                await asyncio.sleep(max(0.0, t0 + i * CHUNK_MS / 1e3 - time.perf_counter()))
                await conn.input_audio_buffer.append(audio=chunk)

        t0 = time.perf_counter()
        speaking = asyncio.create_task(speak())
        dropping = asyncio.ensure_future(asyncio.to_thread(stages.wait_dropped, before, 10.0))
        vad_at = done_at = None
        try:
            while done_at is None:
                ev = await next_event(conn, 10.0)
                if ev["type"] == "input_audio_buffer.speech_started" and vad_at is None:
                    vad_at = time.perf_counter()
                elif ev["type"] == "response.done":
                    done_at = time.perf_counter()
                    response = ev["response"]
                    if response["status"] != "cancelled":
                        raise RuntimeError(f"the response ended {response['status']}")
                elif ev["type"] == "error":
                    raise RuntimeError(f"error event: {ev['error']}")
            dropped_at = await dropping
        finally:
            speaking.cancel()
            dropping.cancel()
            await asyncio.gather(speaking, return_exceptions=True)
    if vad_at is None:
        raise RuntimeError("no speech_started before the response ended")
    return BargeIn(*((t - t0) * 1e3 for t in (vad_at, done_at, dropped_at)))


def expected_samples(text: str) -> int:
    """The demo's audio for `text` at 24 kHz: 20 ms per letter of each token."""
    return round(sum(0.020 * len(t) for t in re.findall(r"\w+|[^\w\s]", text)) * RATE)


@dataclass
class Sessions:
    sessions: int
    heard: list[Playback] = field(default_factory=list)
    ttfa_ms: list[float] = field(default_factory=list)
    completed: int = 0
    turns: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def no_gap_share(self) -> float:
        return sum(h.worst_gap_s <= AUDIBLE_GAP_S for h in self.heard) / max(1, self.turns)


async def one_session(
    serve: ServeProcess, k: int, turns: int, out: Sessions, rng: random.Random
) -> None:
    try:
        async with client(serve).realtime.connect(model="omni") as conn:
            await conn.session.update(session={
                "type": "realtime", "output_modalities": ["audio"],
                "audio": {"input": {"turn_detection": None}},
            })  # fmt: skip
            for turn in range(turns):
                out.turns += 1
                words = [WORDS[(k * 7 + turn * 3 + i) % len(WORDS)] for i in range(25)]
                text = " ".join(words)
                await conn.conversation.item.create(item=text_item(text))
                t0 = time.perf_counter()
                await conn.response.create()
                heard, samples, status = Playback(), 0, None
                while status is None:
                    ev = await next_event(conn)
                    if ev["type"] == "response.output_audio.delta":
                        n = len(base64.b64decode(ev["delta"])) // 2
                        now = time.perf_counter()
                        if heard.started_at is None:
                            out.ttfa_ms.append((now - t0) * 1e3)
                        heard.add(now, n / RATE)
                        samples += n
                    elif ev["type"] == "response.done":
                        status = ev["response"]["status"]
                    elif ev["type"] == "error":
                        out.errors.append(f"session {k}: error event {ev['error']}")
                out.heard.append(heard)
                if status == "completed" and abs(samples - expected_samples(text)) <= 48:
                    out.completed += 1
                else:
                    out.errors.append(f"session {k} turn {turn}: {status}, {samples} samples")
                await asyncio.sleep(rng.uniform(0, 0.040))
    except Exception as e:  # counted: a session that breaks is an error
        out.errors.append(f"session {k}: {type(e).__name__}: {e}")


async def sessions_at_once(serve: ServeProcess, n: int, turns: int) -> Sessions:
    out = Sessions(n)
    rng = random.Random(n)
    await asyncio.gather(*(one_session(serve, k, turns, out, rng) for k in range(n)))
    return out


async def measure(ctx: scenario.Context, sizes: Sizes) -> tuple[list[BargeIn], Sessions, Sessions]:
    chunks = speech_chunks()
    d = Deployment(ctx.redis_url, OMNI, "realtime", mode="streaming",
                   extra_env={"OMNI_HEARTBEAT_INTERVAL_S": str(BEAT_S)})  # fmt: skip
    serve = for_deployment(d, OMNI, ctx.log_dir, {"OMNI_API_KEYS": KEY})
    try:
        d.start()
        await d.wait_ready()
        serve.start()
        stages = Stages(d)
        await watched([d], sessions_at_once(serve, 1, 1), 120)  # warm-up
        tries = []
        for _ in range(sizes.barge_ins):
            tries.append(await watched([d], barge_in(serve, stages, chunks), 60))
        print(f"  {len(tries)} barge-ins, load average {os.getloadavg()[0]:.1f}")
        alone = await watched([d], sessions_at_once(serve, 1, sizes.turns), 300)
        many = await watched([d], sessions_at_once(serve, sizes.sessions, sizes.turns), 900)
        print(f"  {sizes.sessions} sessions x {sizes.turns} turns: {len(many.errors)} errors, "
              f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        serve.check_alive()
        return tries, alone, many
    finally:
        serve.stop()
        d.stop()


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    tries, alone, many = asyncio.run(measure(ctx, sizes))
    total = [t.total_ms for t in tries]
    vad = [t.vad_ms for t in tries]
    parts = {name: [getattr(t, f"{name}_ms") for t in tries] for name in ("vad", "done", "dropped")}
    p99 = percentile(total, 99)
    rows = [Row(
        "realtime", f"barge-in, {len(tries)} tries", "speech start -> cancelled, every stage dropped",
        "ms", percentile(total, 50), min(total), max(total), percentile(total, 50), p99,
        baseline="speech start -> speech_started", baseline_value=percentile(vad, 50),
        ratio=ratio(percentile(total, 50), percentile(vad, 50)),
        target=f"p99 <= {TARGET_BARGE_IN_MS:g} ms", met=p99 <= TARGET_BARGE_IN_MS,
        notes=[f"{k} p50 {percentile(v, 50):.0f} ms, p99 {percentile(v, 99):.0f} ms"
               for k, v in parts.items()] + [f"heartbeats every {BEAT_S * 1e3:g} ms: the "
               "dropped time is late by up to one"],
        details={k: v for k, v in parts.items()},
    )]  # fmt: skip
    cfg = f"{many.sessions} sessions x {sizes.turns} turns"
    ok = not many.errors
    rows.append(Row(
        "realtime", cfg, "turns completed", "%", 100 * many.completed / max(1, many.turns),
        baseline="1 session", baseline_value=100 * alone.completed / max(1, alone.turns),
        target="100 %", met=many.completed == sizes.sessions * sizes.turns,
        notes=[f"{len(many.errors)} errors, e.g. {many.errors[0]}"] if many.errors else [],
        details={"turns": many.turns, "completed": many.completed, "errors": many.errors[:20]},
    ))  # fmt: skip
    gaps = [h.worst_gap_s * 1e3 for h in many.heard] or [0.0]
    rows.append(Row(
        "realtime", cfg, f"turns with no gap > {AUDIBLE_GAP_S * 1e3:g} ms", "%",
        100 * many.no_gap_share, baseline="1 session", baseline_value=100 * alone.no_gap_share,
        ratio=ratio(many.no_gap_share, alone.no_gap_share),
        target=f">= {TARGET_CONTINUITY:.0%}", met=ok and many.no_gap_share >= TARGET_CONTINUITY,
        notes=[f"worst gap per turn p50 {percentile(gaps, 50):.0f} ms, p99 "
               f"{percentile(gaps, 99):.0f} ms, max {max(gaps):.0f} ms"],
    ))  # fmt: skip
    rows.append(Row("realtime", cfg, "errors", "", float(len(many.errors)), target="0",
                    met=not many.errors))  # fmt: skip
    if many.ttfa_ms and alone.ttfa_ms:
        rows.append(Row(
            "realtime", cfg, "response.create -> first audio", "ms",
            percentile(many.ttfa_ms, 50), None, None, percentile(many.ttfa_ms, 50),
            percentile(many.ttfa_ms, 99), baseline="1 session",
            baseline_value=percentile(alone.ttfa_ms, 50),
            ratio=ratio(percentile(many.ttfa_ms, 50), percentile(alone.ttfa_ms, 50)),
        ))  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("realtime", __doc__, run, FULL, QUICK))
