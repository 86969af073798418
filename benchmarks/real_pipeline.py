"""The real voice pipeline (SmolLM2 thinker -> piper talker -> piper vocoder), streaming vs sequential.

`workers/voice.yaml`, both modes deployed at once as processes, each in its own
namespace; load from one `OmniClient` here, closed loop at each concurrency, the
modes' cells interleaved. Each request asks a different question (so no answer is
canned, and llama.cpp's prompt cache helps no cell more than another) with the same
`max_tokens` and the question's own seed, so both modes speak the same answers. Per
request, from just before `submit`: TTFT (first text piece), TTFA (first audio chunk),
E2E (the finished output), the audio's length, and what a listener hears
(`omni_runtime.client.playback`: playback starts at the first audio and runs in
real time; silence after a chunk played out is a gap). Real-time factor: the request's
E2E over the seconds of audio it made (below 1: made faster than it plays).

Baseline: sequential mode at the same concurrency. Targets (c = 1): TTFA p50 at least
3x sooner streaming; E2E no slower. At c = 4: at least 95 % of requests hear no gap
over 200 ms once their audio started.

Abort: a third deployment whose thinker has one slot. A long answer holds it, a second
request waits for it, the first is aborted: the time from `abort` to the second's first
token, less the same-run time to first token of a request finding the slot free, is how
long the slot stayed taken after the abort (target: at most 100 ms).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis
import yaml

from benchmarks.harness import scenario
from benchmarks.harness.procs import Deployment, watched
from benchmarks.harness.report import ROOT, Row, ratio
from benchmarks.harness.stats import percentile
from omni_runtime.client.client import OmniClient
from omni_runtime.client.playback import Playback, audio_seconds
from omni_runtime.pipeline import load_pipeline

VOICE = ROOT / "workers" / "voice.yaml"
MODES = ("sequential", "streaming")
GAP_S = 0.2
TARGET_TTFA = 3.0
TARGET_E2E = 1.0
TARGET_CONTINUITY = 0.95
TARGET_ABORT_MS = 100.0
LONG = "Write a long story about a dragon and a knight, with many details."
QUESTIONS = [
    "Why is the sky blue?", "What do bees make?", "Describe a rainy morning.",
    "Why do cats purr?", "What is a volcano?", "How do birds fly?", "What is the moon made of?",
    "Describe the ocean.", "Why do leaves fall?", "What is a rainbow?", "How do fish breathe?",
    "What is thunder?", "Describe a forest at night.", "Why is snow white?",
    "What do farmers grow?", "How does a bridge stand?",
]  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    concurrencies: tuple[int, ...]
    requests: int
    """Per mode and concurrency."""
    max_tokens: int
    warmup: int = 2
    aborts: int = 10


FULL = Sizes(concurrencies=(1, 2, 4), requests=16, max_tokens=64)
QUICK = Sizes(concurrencies=(1, 4), requests=8, max_tokens=64, warmup=1, aborts=4)


@dataclass
class Cell:
    mode: str
    concurrency: int
    ms: dict[str, list[float]] = field(default_factory=lambda: {"ttft": [], "ttfa": [], "e2e": []})
    rtf: list[float] = field(default_factory=list)
    heard: list[Playback] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def p(self, metric: str, q: float) -> float | None:
        values = self.rtf if metric == "rtf" else self.ms[metric]
        return percentile(values, q) if values else None

    @property
    def continuous_share(self) -> float:
        heard = [h for h in self.heard if h.started_at is not None]
        return sum(h.worst_gap_s <= GAP_S for h in heard) / len(heard) if heard else 0.0


async def one_request(client: OmniClient, question: str, sizes: Sizes, cell: Cell) -> None:
    rate = load_pipeline(VOICE).outputs
    assert rate is not None and rate.audio_stage is not None
    t0 = time.perf_counter()
    ttft = ttfa = None
    text: list[str] = []
    audio_s = 0.0
    heard = Playback()
    try:
        # The question's own seed: both modes speak the same answers (a request id's seed
        # would make them differ in length, and E2E with them).
        seed = QUESTIONS.index(question)
        rid = await client.submit(question, params={"max_tokens": sizes.max_tokens, "seed": seed})
        async for out in client.stream(rid, timeout_s=120):
            now = time.perf_counter()
            if out.error is not None:
                cell.errors.append(f"stage {out.stage_id}: {out.error}")
                return
            if out.stage_id == rate.text_stage and out.data:
                text.append(str(out.data))
                ttft = ttft or now
            elif out.stage_id == rate.audio_stage and out.data is not None:
                pcm = np.asarray(out.data)
                if pcm.size:
                    seconds = audio_seconds(pcm, rate.sample_rate)
                    audio_s += seconds
                    ttfa = ttfa or now
                    heard.add(now, seconds)
    except TimeoutError as e:
        cell.errors.append(str(e))
        return
    end = time.perf_counter()
    if not "".join(text).strip() or ttft is None or ttfa is None or audio_s <= 0:
        cell.errors.append(f"{len(text)} text pieces, {audio_s:.2f} s of audio")
        return
    for metric, t in (("ttft", ttft), ("ttfa", ttfa), ("e2e", end)):
        cell.ms[metric].append((t - t0) * 1e3)
    cell.rtf.append((end - t0) / audio_s)
    cell.heard.append(heard)


async def closed_loop(d: Deployment, conc: int, n: int, sizes: Sizes, offset: int) -> Cell:
    cell = Cell(d.mode, conc)
    todo = list(range(n))
    started = time.perf_counter()
    async with OmniClient(d.settings) as client:

        async def user() -> None:
            while todo:
                i = todo.pop()
                await one_request(client, QUESTIONS[(offset + i) % len(QUESTIONS)], sizes, cell)

        await asyncio.gather(*(user() for _ in range(conc)))
    cell.wall_s = time.perf_counter() - started
    return cell


class FirstToken:
    """Reads a request to its end, noting when its first text piece came."""

    def __init__(self, client: OmniClient, rid: str) -> None:
        self.rid = rid
        self.at: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.ended = asyncio.create_task(self._read(client, rid))

    async def _read(self, client: OmniClient, rid: str) -> None:
        async for out in client.stream(rid, timeout_s=120):
            if out.stage_id == 0 and out.data and not self.at.done():
                self.at.set_result(time.perf_counter())
        if not self.at.done():
            self.at.set_exception(RuntimeError(f"{rid} ended without text"))


def thinker_waiting(d: Deployment, r: redis.Redis) -> int:
    """Requests waiting for a thinker slot, from the thinker's heartbeat (`status`)."""
    for key in r.scan_iter(d.settings.names.heartbeat_pattern(0)):
        return int(json.loads(r.get(key) or "{}").get("engine", {}).get("waiting", 0))
    return 0


async def abort_cell(d: Deployment, tries: int) -> tuple[list[float], list[float]]:
    """([time to first token on a free slot], [abort → the waiting request's first token]), s."""
    free, after_abort = [], []
    r = redis.Redis.from_url(d.redis_url)
    params = {"max_tokens": 400}
    async with OmniClient(d.settings) as client:
        for k in range(tries):
            t0 = time.perf_counter()
            alone = await client.submit(LONG, params={**params, "seed": k})
            reading = FirstToken(client, alone)
            free.append(await asyncio.wait_for(reading.at, 120) - t0)
            await client.abort(alone)
            await asyncio.wait_for(reading.ended, 30)
            holder = FirstToken(client, await client.submit(LONG, params={**params, "seed": 99}))
            await asyncio.wait_for(holder.at, 120)
            waiter = FirstToken(client, await client.submit(LONG, params={**params, "seed": k}))
            deadline = time.monotonic() + 30
            while thinker_waiting(d, r) < 1:  # the waiter is queued at the engine
                if time.monotonic() > deadline:
                    raise TimeoutError("the second request never waited for the slot")
                await asyncio.sleep(0.05)
            aborted_at = time.perf_counter()
            await client.abort(holder.rid)
            after_abort.append(await asyncio.wait_for(waiter.at, 60) - aborted_at)
            await client.abort(waiter.rid)
            await asyncio.wait_for(asyncio.gather(holder.ended, waiter.ended), 30)
    r.close()
    return free, after_abort


def one_slot_pipeline() -> Path:
    raw = yaml.safe_load(VOICE.read_text())
    raw["stages"][0]["options"]["n_parallel"] = 1
    path = Path(tempfile.mkdtemp()) / "voice-one-slot.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


async def measure(
    sizes: Sizes, redis_url: str
) -> tuple[list[Cell], tuple[list[float], list[float]]]:
    deployments = {m: Deployment(redis_url, VOICE, f"voice-{m[:3]}", mode=m) for m in MODES}
    one_slot = Deployment(redis_url, one_slot_pipeline(), "voice-abort", mode="streaming")
    try:
        for d in deployments.values():
            d.start()
        for d in deployments.values():
            await d.wait_ready()
        all_d = list(deployments.values())
        for d in all_d:  # warm-up: model pages, ONNX sessions, connections
            await watched(all_d, closed_loop(d, 1, sizes.warmup, sizes, 0), 300)
        cells = []
        for conc in sizes.concurrencies:
            for mode in MODES:
                cell = await watched(
                    all_d, closed_loop(deployments[mode], conc, sizes.requests, sizes, conc), 900
                )
                print(f"  {mode:<10} c={conc} {sizes.requests} requests, {len(cell.errors)} "
                      f"errors, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
                cells.append(cell)
        for d in all_d:
            d.stop()
        one_slot.start()
        await one_slot.wait_ready()
        aborts = await watched([one_slot], abort_cell(one_slot, sizes.aborts), 600)
        return cells, aborts
    finally:
        for d in [*deployments.values(), one_slot]:
            d.stop()


def cell_table(cells: list[Cell]) -> str:
    lines = [
        "| concurrency | mode | TTFT | TTFA | end to end | RTF | no gap > 200 ms | worst gap "
        "| requests/s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        cols = [f"{c.p(m, 50) or 0:.0f} ({c.p(m, 99) or 0:.0f})" for m in ("ttft", "ttfa", "e2e")]
        gaps = [h.worst_gap_s * 1e3 for h in c.heard if h.started_at is not None] or [0.0]
        cols += [
            f"{c.p('rtf', 50) or 0:.2f}",
            f"{c.continuous_share:.0%}",
            f"{percentile(gaps, 50):.0f} ({percentile(gaps, 99):.0f})",
            f"{len(c.ms['e2e']) / max(c.wall_s, 1e-9):.2f}",
        ]
        lines.append(f"| {c.concurrency} | {c.mode} | {' | '.join(cols)} | {len(c.errors)} |")
    return "\n".join(lines)


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    cells, (free, after_abort) = asyncio.run(measure(sizes, ctx.redis_url))
    print("\nLatency, ms: p50 (p99)\n" + cell_table(cells) + "\n")
    rows = []
    for conc in sizes.concurrencies:
        seq, st = (next(c for c in cells if c.mode == m and c.concurrency == conc) for m in MODES)
        ok = not seq.errors and not st.errors
        notes = [
            f"{c.mode}: {len(c.errors)} failed, e.g. {c.errors[0]}" for c in (seq, st) if c.errors
        ]
        for metric in ("ttfa", "e2e", "rtf"):
            value, base = st.p(metric, 50), seq.p(metric, 50)
            if metric == "ttfa":
                r, target = (
                    ratio(base, value),
                    f"seq/stream >= {TARGET_TTFA:g}x" if conc == 1 else "",
                )
                met = (ok and r is not None and r >= TARGET_TTFA) if conc == 1 else None
            elif metric == "e2e":
                r, target = (
                    ratio(value, base),
                    f"stream/seq <= {TARGET_E2E:g}x" if conc == 1 else "",
                )
                met = (ok and r is not None and r <= TARGET_E2E) if conc == 1 else None
            else:
                r, target, met = ratio(value, base), "", None
            unit = "x" if metric == "rtf" else "ms"
            rows.append(Row(
                "real_pipeline", f"c={conc}, streaming", f"{metric.upper()} p50", unit,
                value or float("nan"), None, None, value if unit == "ms" else None,
                st.p(metric, 99) if unit == "ms" else None, baseline="sequential",
                baseline_value=base, ratio=r, ratio_of="seq/stream" if metric == "ttfa" else
                "stream/seq", target=target, met=met, notes=notes,
                details={"requests": len(st.ms["e2e"]), "sequential_p99": seq.p(metric, 99)},
            ))  # fmt: skip
        need = TARGET_CONTINUITY if conc == 4 else None
        rows.append(Row(
            "real_pipeline", f"c={conc}, streaming", "continuity", "%", 100 * st.continuous_share,
            baseline="sequential", baseline_value=100 * seq.continuous_share,
            target=f">= {need:.0%} no gap > {GAP_S * 1e3:g} ms" if need else "",
            met=None if need is None else ok and st.continuous_share >= need,
        ))  # fmt: skip
    base = percentile(free, 50) * 1e3
    held = [max(0.0, s * 1e3 - base) for s in after_abort]
    print(f"abort -> waiting request's first token, ms: p50 {percentile(after_abort, 50) * 1e3:.0f}"
          f" p99 {percentile(after_abort, 99) * 1e3:.0f}; free slot's first token p50 {base:.0f}")  # fmt: skip
    rows.append(Row(
        "real_pipeline", "abort, 1 thinker slot", "slot held after abort", "ms",
        percentile(held, 50), None, None, percentile(held, 50), percentile(held, 99),
        baseline="first token on a free slot", baseline_value=base,
        target=f"p50 <= {TARGET_ABORT_MS:g} ms", met=percentile(held, 50) <= TARGET_ABORT_MS,
        details={"tries": len(held), "abort_to_first_token_ms": [s * 1e3 for s in after_abort]},
    ))  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("real_pipeline", __doc__, run, FULL, QUICK))
