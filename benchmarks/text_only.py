"""Text chats of a pipeline that speaks: what not running its TTS stages saves.

`workers/voice.yaml` (SmolLM2 on llama.cpp, then piper) deployed twice as processes on
one redis-server, streaming: as it is, and as a copy whose `outputs` name no audio
stage, so that the orchestrator runs every stage for a request that wants no audio and
its TTS stages pass the text by, as every text chat ran before a request's final stages
left the audio stage out (`core/types.request_finals`). Every request asks for no audio
(`modalities: ["text"]`, what the front door adds for a text chat), the same questions
with the same seeds to both; closed loop at concurrency 4, the deployments' rounds
alternated. Per request: the on-CPU time of every process over the round
(`/proc/<pid>/task/*/schedstat`), the thinker's apart from the runtime's own (the
orchestrator, the other stages, this client, redis-server), and the time to the end.

Baseline: the copy that runs every stage, in the same run. No target: the thinker sets
requests/s and E2E, which move within the noise; the runtime's own CPU is what changes.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from benchmarks.harness import scenario
from benchmarks.harness.cpu import proc_cpu_ns
from benchmarks.harness.procs import Deployment
from benchmarks.harness.redis import server_pid
from benchmarks.harness.report import ROOT, Row, ratio
from benchmarks.harness.stats import percentile
from benchmarks.real_pipeline import QUESTIONS
from omni_runtime.client.client import OmniClient

VOICE = ROOT / "workers" / "voice.yaml"
VARIANTS = ("text stage only", "every stage")


@dataclass(frozen=True)
class Sizes:
    rounds: int
    requests: int
    """Per deployment and round."""
    concurrency: int = 4
    max_tokens: int = 64


FULL = Sizes(rounds=4, requests=16)
QUICK = Sizes(rounds=2, requests=8)


@dataclass
class Variant:
    runtime_ms: list[float] = field(default_factory=list)
    """The runtime's own CPU per request, one figure per round."""
    thinker_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    per_second: list[float] = field(default_factory=list)
    processes: dict[str, list[float]] = field(default_factory=dict)


def every_stage_copy(where: Path) -> Path:
    """voice.yaml whose outputs name no audio stage: no request leaves a stage out."""
    pipeline = yaml.safe_load(VOICE.read_text())
    del pipeline["outputs"]["audio_stage"]
    path = where / "voice-every-stage.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    return path


async def one_round(d: Deployment, client: OmniClient, sizes: Sizes, got: Variant) -> None:
    pids = {**d.pids(), "client": os.getpid()}
    if (redis_pid := server_pid(d.redis_url)) is not None:
        pids["redis-server"] = redis_pid
    todo = list(range(sizes.requests))

    async def user() -> None:
        while todo:
            k = todo.pop()
            params = {"modalities": ["text"], "max_tokens": sizes.max_tokens, "seed": k}
            t0 = time.perf_counter()
            rid = await client.submit(QUESTIONS[k % len(QUESTIONS)], params=params)
            async for out in client.stream(rid, timeout_s=120):
                if out.error is not None:
                    raise RuntimeError(f"stage {out.stage_id}: {out.error}")
            got.e2e_ms.append((time.perf_counter() - t0) * 1e3)

    before = {name: proc_cpu_ns(pid) for name, pid in pids.items()}
    started = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(sizes.concurrency)))
    got.per_second.append(sizes.requests / (time.perf_counter() - started))
    spent = {}
    for name, pid in pids.items():
        start, end = before[name], proc_cpu_ns(pid)
        if start is not None and end is not None:
            spent[name.rsplit("-", 1)[0]] = (end - start) / 1e6 / sizes.requests
    for name, ms in spent.items():
        got.processes.setdefault(name, []).append(ms)
    thinker = sum(ms for name, ms in spent.items() if "thinker" in name)
    got.thinker_ms.append(thinker)
    got.runtime_ms.append(sum(spent.values()) - thinker)


async def measure(ctx: scenario.Context, sizes: Sizes) -> dict[str, Variant]:
    paths = {VARIANTS[0]: VOICE, VARIANTS[1]: every_stage_copy(ctx.log_dir)}
    deployments = {
        name: Deployment(ctx.redis_url, path, f"text-{k}", mode="streaming").start()
        for k, (name, path) in enumerate(paths.items())
    }
    got = {name: Variant() for name in VARIANTS}
    try:
        for d in deployments.values():
            await d.wait_ready()
        clients = {name: OmniClient(d.settings) for name, d in deployments.items()}
        for client in clients.values():
            await client.__aenter__()
        try:
            for name in VARIANTS:  # warm-up: llama.cpp's first prompts, piper's first call
                await one_round(deployments[name], clients[name], QUICK, Variant())
            for r in range(sizes.rounds):
                for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                    await one_round(deployments[name], clients[name], sizes, got[name])
        finally:
            for client in clients.values():
                await client.close()
    finally:
        for d in deployments.values():
            d.stop()
    return got


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    got = asyncio.run(measure(ctx, sizes))
    cfg = f"voice.yaml streaming, c={sizes.concurrency}, {sizes.requests} x {sizes.rounds}"
    new, old = got[VARIANTS[0]], got[VARIANTS[1]]
    rows = []
    for metric, of in (("runtime's own CPU per text chat", "runtime_ms"),
                       ("thinker's CPU per text chat", "thinker_ms")):  # fmt: skip
        mine, base = getattr(new, of), getattr(old, of)
        per = {k: round(statistics.median(v), 1) for k, v in new.processes.items()}
        was = {k: round(statistics.median(v), 1) for k, v in old.processes.items()}
        rows.append(Row(
            "text_only", cfg, metric, "ms", statistics.median(mine), min(mine), max(mine),
            baseline="every stage run", baseline_value=statistics.median(base),
            ratio=ratio(statistics.median(mine), statistics.median(base)),
            notes=[f"per process: {per}; every stage run: {was}"] if of == "runtime_ms" else [],
        ))  # fmt: skip
    e2e, e2e_base = new.e2e_ms, old.e2e_ms
    rows.append(Row(
        "text_only", cfg, "question -> end", "ms", percentile(e2e, 50), min(e2e), max(e2e),
        percentile(e2e, 50), percentile(e2e, 99), baseline="every stage run",
        baseline_value=percentile(e2e_base, 50),
        ratio=ratio(percentile(e2e, 50), percentile(e2e_base, 50)),
    ))  # fmt: skip
    rate, rate_base = statistics.median(new.per_second), statistics.median(old.per_second)
    rows.append(Row(
        "text_only", cfg, "requests/s", "/s", rate, min(new.per_second), max(new.per_second),
        baseline="every stage run", baseline_value=rate_base, ratio=ratio(rate, rate_base),
    ))  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("text_only", __doc__, run, FULL, QUICK))
