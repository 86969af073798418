"""Time to first audio packet and audio continuity: the omni demo, sequential vs streaming.

`workers/omni.yaml` (thinker -> talker -> code2wav, finals {0, 2}) with its real-time
pacing (50 tokens/s, talker 10x and vocoder 50x faster than real time), both modes
deployed at once as processes, each in its own namespace; load from one `OmniClient`
here. Prompt: 50 distinct words (~6 s of audio). Closed loop: C tasks, each submitting
its next request a random think time (uniform over two decode steps, 0-40 ms, the same
draws in both modes) after the previous one finished. Without it the loop measures a
phase lock, not the runtime: the thinker admits a request at its next 20 ms step, and in
streaming mode a request ends a fixed path after a step, so every resubmission met the
step clock at the same phase and streaming TTFT was one point of the [20, 40] ms
admission window (deciles 37-43 ms) where sequential mode sampled all of it (24-51 ms).
Per request, from just before `submit`: TTFT (first text token out of
`OmniClient.stream`), TTFP (first stage-2 output with audio samples), E2E (the finished
output), and what a listener hears (`omni_runtime.client.playback`: playback starts with the
first audio and runs in real time; a chunk that comes after the audio before it played
out is a gap). Every request is checked (the tokens in order, the number of audio
samples). Cells of the two modes are interleaved per concurrency. The TTFT rows' notes
give each process's CPU per token in both modes (from `/proc`, this client included) and
how busy the machine was: at the same concurrency streaming serves about twice the
requests per second, so where the machine runs out is where its first tokens wait.

Baseline: sequential mode at the same concurrency. Ratios on p50: TTFP seq/stream
(higher is better), TTFT and E2E stream/seq (lower is better); continuity (share of
requests with no gap over 100 ms) stream/seq.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness import scenario
from benchmarks.harness.cpu import MACHINE, OTHER, CpuSampler
from benchmarks.harness.procs import Deployment, watched
from benchmarks.harness.redis import server_pid
from benchmarks.harness.report import ROOT, Row, ratio
from benchmarks.harness.stats import percentile
from omni_runtime.client.client import OmniClient
from omni_runtime.client.playback import AUDIBLE_GAP_S, Continuity, Playback, audio_seconds
from omni_runtime.pipeline import load_pipeline

OMNI = ROOT / "workers" / "omni.yaml"
MODES = ("sequential", "streaming")
TEXT_STAGE, AUDIO_STAGE = 0, 2
TOKENS = 50
TOKEN_DELAY_S = 0.020
THINK_MAX_S = 2 * TOKEN_DELAY_S
"""A user's think time before each request: uniform in [0, this) (see the module's doc)."""
RATE = 16000
FRAME_SAMPLES = RATE * 20 // 1000  # code2wav: sample_rate x frame_ms, per letter of a token
TARGET_TTFP = {1: 10.0, 32: 10.0, 64: 5.0}
"""Sequential / streaming TTFP p50 at least this, by concurrency."""
TARGET_TTFT = 1.1
TARGET_E2E = 1.0
TARGET_CONTINUITY = {32: 0.99, 64: 0.95}
"""Streaming: share of requests with no gap over 100 ms at least this, by concurrency."""
_WORDS_TEXT = (
    "the quick brown fox jumps over lazy dogs while seven wizards quietly hum bright songs "
    "about distant rivers mountains forests oceans cities bridges lanterns gardens meadows "
    "thunder whispers shadows crystal engines harbors valleys silver copper golden marble "
    "velvet amber cedar willow falcon heron otter badger lynx raven sparrow maple birch"
)
WORDS = _WORDS_TEXT.split()


@dataclass(frozen=True)
class Sizes:
    concurrencies: tuple[int, ...]
    rounds: int
    """Requests per client task (closed loop), at least."""
    min_requests: int
    """Requests per cell, at least, as long as no task makes more than `max_rounds`."""
    warmup: int
    max_rounds: int = 20

    def requests(self, concurrency: int) -> int:
        return max(min(self.min_requests, self.max_rounds * concurrency), concurrency * self.rounds)


FULL = Sizes(concurrencies=(1, 8, 32, 64), rounds=3, min_requests=96, warmup=4)
QUICK = Sizes(concurrencies=(1, 8, 64), rounds=2, min_requests=32, warmup=2, max_rounds=4)
"""Two rounds at c = 64: one is a cold burst of 64 at once, not the full run's steady load
(streaming TTFT 1.13-1.26x sequential's in such bursts: requests wait 3-9 ms for the
orchestrator's read while the talker and vocoder start their chunk traffic)."""
TTFT_JUDGED_FROM = 96
"""The TTFT target is judged from this many requests a mode. A first token waits out the
thinker's step under way, then a step (20-40 ms in both modes), so a p50 of n moves ~7 ms
/ sqrt(n): with 8 requests a quick run gave 27 ms sequential, 43 ms streaming (160 traced
at c = 8: 34.2, 35.0 ms); with 32, seven quick runs gave ratios 0.94-1.27."""


@dataclass
class Cell:
    """One mode at one concurrency: per-metric sample lists (ms) and failures."""

    mode: str
    concurrency: int
    ms: dict[str, list[float]] = field(default_factory=lambda: {"ttft": [], "ttfp": [], "e2e": []})
    errors: list[str] = field(default_factory=list)
    heard: list[Playback] = field(default_factory=list)
    load: float = 0.0
    """The machine's 1-minute load average when the cell ended."""
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds per process over the cell (the deployment's, this client's, Redis's)."""
    wall_s: float = 0.0

    def cpu_note(self) -> str:
        """CPU per token streamed, per process, and the machine's share: what bounds it."""
        tokens = max(1, len(self.ms["e2e"]) * TOKENS)
        procs = ", ".join(
            f"{name.removesuffix('-0')} {1e3 * s / tokens:.3f}"
            for name, s in self.cpu_s.items()
            if name not in (MACHINE, OTHER)
        )
        busy = 100 * self.cpu_s.get(MACHINE, 0.0) / max(self.wall_s, 1e-9)
        return (
            f"{self.mode}: CPU ms per token: {procs}; machine {busy:.0f} % of {os.cpu_count()} CPUs"
        )

    @property
    def continuity(self) -> Continuity:
        return Continuity.of(self.heard)

    def p(self, metric: str, q: float) -> float | None:
        values = self.ms[metric]
        return percentile(values, q) if values else None


async def one_request(client: OmniClient, prompt: str, tokens: list[str], cell: Cell) -> None:
    t0 = time.perf_counter()
    ttft = ttfp = None
    texts: list[Any] = []
    samples = 0
    heard = Playback()
    try:
        rid = await client.submit(prompt)
        async for out in client.stream(rid, timeout_s=30):
            now = time.perf_counter()
            if out.error is not None:
                cell.errors.append(f"stage {out.stage_id}: {out.error}")
                return
            if out.stage_id == TEXT_STAGE:
                texts.append(out.data)
                ttft = ttft or now
            elif out.stage_id == AUDIO_STAGE and len(out.data) > 0:
                samples += len(out.data)
                ttfp = ttfp or now
                heard.add(now, audio_seconds(out.data, RATE))
    except TimeoutError as e:
        cell.errors.append(str(e))
        return
    end = time.perf_counter()
    expected_samples = sum(len(t) for t in tokens) * FRAME_SAMPLES
    if texts != tokens or samples != expected_samples or ttft is None or ttfp is None:
        cell.errors.append(f"{len(texts)} tokens, {samples} samples (want {expected_samples})")
        return
    for metric, t in (("ttft", ttft), ("ttfp", ttfp), ("e2e", end)):
        cell.ms[metric].append((t - t0) * 1e3)
    cell.heard.append(heard)


async def closed_loop(d: Deployment, prompt: str, tokens: list[str], conc: int, n: int) -> Cell:
    cell = Cell(d.mode, conc)
    remaining = [n]
    outputs = load_pipeline(OMNI).outputs  # the client observes omni_audio_gap_seconds too
    async with OmniClient(d.settings, outputs=outputs) as client:

        async def user(think: random.Random) -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                await asyncio.sleep(think.uniform(0.0, THINK_MAX_S))
                await one_request(client, prompt, tokens, cell)

        await asyncio.gather(*(user(random.Random(f"{conc}-{i}")) for i in range(conc)))
    return cell


async def measure(ctx: scenario.Context, sizes: Sizes) -> list[Cell]:
    tokens = [WORDS[i % len(WORDS)] + str(i // len(WORDS) or "") for i in range(TOKENS)]
    prompt = " ".join(tokens)
    deployments = {m: Deployment(ctx.redis_url, OMNI, f"ttfp-{m[:3]}", mode=m) for m in MODES}
    one_s = TOKENS * TOKEN_DELAY_S + 1.0
    try:
        for d in deployments.values():
            d.start()
        for d in deployments.values():
            await d.wait_ready()
        all_d = list(deployments.values())
        for d in all_d:  # warm-up: imports, connections, thread pools
            await watched(all_d, closed_loop(d, prompt, tokens, 2, sizes.warmup), 4 * one_s + 60)
        cells = []
        redis_pid = server_pid(ctx.redis_url)
        for conc in sizes.concurrencies:
            n = sizes.requests(conc)
            for mode in MODES:
                timeout_s = one_s * 4 * -(-n // conc) + 60
                pids = deployments[mode].pids() | {"client": os.getpid()}
                if redis_pid is not None:
                    pids["redis-server"] = redis_pid
                sampler, t0 = CpuSampler(pids), time.perf_counter()
                sampler.start()
                cell = await watched(
                    all_d, closed_loop(deployments[mode], prompt, tokens, conc, n), timeout_s
                )
                cell.cpu_s, cell.wall_s = sampler.stop(), time.perf_counter() - t0
                cell.load = os.getloadavg()[0]  # others' runnable processes skew every figure
                print(f"  {mode:<10} c={conc:<3} {n} requests, {len(cell.errors)} errors, "
                      f"load average {cell.load:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
                cells.append(cell)
        return cells
    finally:
        for d in deployments.values():
            d.stop()


def cell_table(cells: list[Cell]) -> str:
    """The docs' table: p50 (p99) in ms per mode and concurrency, and what listeners heard."""
    lines = [
        "| concurrency | mode | TTFT | TTFP | end to end | worst gap | no gap > 100 ms "
        "| stall, total | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        cols = [f"{c.p(m, 50) or 0:.1f} ({c.p(m, 99) or 0:.1f})" for m in ("ttft", "ttfp", "e2e")]
        h = c.continuity
        cols.append(f"{h.worst_gap_p50_s * 1e3:.1f} ({h.worst_gap_p99_s * 1e3:.1f})")
        cols += [f"{h.continuous_share:.1%}", f"{h.stall_s:.2f} s"]
        lines.append(f"| {c.concurrency} | {c.mode} | {' | '.join(cols)} | {len(c.errors)} |")
    return "\n".join(lines)


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    cells = asyncio.run(measure(ctx, sizes))
    print("\nLatency, ms: p50 (p99)\n" + cell_table(cells) + "\n")
    rows = []
    for conc in sizes.concurrencies:
        seq, st = (next(c for c in cells if c.mode == m and c.concurrency == conc) for m in MODES)
        ok = not seq.errors and not st.errors
        errors = [
            f"{c.mode}: {len(c.errors)} failed, e.g. {c.errors[0]}" for c in (seq, st) if c.errors
        ]
        for metric, higher_better in (("ttfp", True), ("ttft", False), ("e2e", False)):
            value, base = st.p(metric, 50), seq.p(metric, 50)
            r = ratio(base, value) if higher_better else ratio(value, base)
            if metric == "ttfp":
                need = TARGET_TTFP.get(conc)
                target = f"seq/stream >= {need:g}x" if need else ""
                met = None if need is None else ok and r is not None and r >= need
            else:
                limit = TARGET_TTFT if metric == "ttft" else TARGET_E2E
                target, met = f"stream/seq <= {limit:g}x", ok and r is not None and r <= limit
            notes = []
            if metric == "ttft" and min(len(seq.ms[metric]), len(st.ms[metric])) < TTFT_JUDGED_FROM:
                met, notes = None, [f"not judged: fewer than {TTFT_JUDGED_FROM} requests a mode"]
            rows.append(Row(
                "ttfp", f"c={conc}, streaming", f"{metric.upper()} p50", "ms", value or float("nan"),
                None, None, value, st.p(metric, 99), baseline="sequential", baseline_value=base,
                ratio=r, ratio_of="seq/stream" if higher_better else "stream/seq", target=target,
                met=met, notes=errors if metric == "ttfp" else (
                    [*notes, st.cpu_note(), seq.cpu_note()] if metric == "ttft" else notes),
                details={"sequential_p99_ms": seq.p(metric, 99), "requests": len(st.ms[metric]),
                         "load_average": st.load},
            ))  # fmt: skip
        rows += continuity_rows(conc, seq, st, ok)
    return rows


def continuity_rows(conc: int, seq: Cell, st: Cell, ok: bool) -> list[Row]:
    """Streaming's share of requests heard with no gap over 100 ms, against sequential's;
    then the worst gap per request (p50, p99 columns) and the total stall."""
    h, base = st.continuity, seq.continuity
    need = TARGET_CONTINUITY.get(conc)
    gap = Row(
        "ttfp", f"c={conc}, streaming", "worst gap", "ms", h.worst_gap_p50_s * 1e3,
        p50_ms=h.worst_gap_p50_s * 1e3, p99_ms=h.worst_gap_p99_s * 1e3, baseline="sequential",
        baseline_value=base.worst_gap_p50_s * 1e3, notes=[f"total stall {h.stall_s:.2f} s "
        f"over {h.requests} requests (sequential: {base.stall_s:.2f} s)"],
    )  # fmt: skip
    return [Row(
        "ttfp", f"c={conc}, streaming", "continuity", "%", 100 * h.continuous_share,
        baseline="sequential", baseline_value=100 * base.continuous_share,
        ratio=ratio(h.continuous_share, base.continuous_share), ratio_of="stream/seq",
        target=f">= {need:.0%} no gap > {AUDIBLE_GAP_S * 1e3:g} ms" if need else "",
        met=None if need is None else ok and h.continuous_share >= need,
        details={
            "requests": h.requests, "stall_s": h.stall_s, "sequential_stall_s": base.stall_s,
            "worst_gap_p50_ms": h.worst_gap_p50_s * 1e3, "worst_gap_p99_ms": h.worst_gap_p99_s * 1e3,
            "sequential_worst_gap_p99_ms": base.worst_gap_p99_s * 1e3,
        },
    ), gap]  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(scenario.main("ttfp", __doc__, run, FULL, QUICK))
