"""Where a streaming request's first token and first audio go inside omni-runtime: the
runtime's trace stamps beside what the client sees.

`python -m benchmarks.peers.first_audio [--n 20] [--conc 1] [--redis-url URL]` deploys
`workers/omni.yaml` in streaming mode with `OMNI_TRACE_FILE` set, sends the peers
benchmark's prompt `n` times from this process (`conc` users, each thinking 0-40 ms
before its next request, a few requests first to warm up) and prints, per hand-off
point, its p50 in ms after the client's `submit` call began: the client's stamp, the
orchestrator's read of the request, its submission of each stage's input, each worker's
read of it, the orchestrator's read of each stage's first output, then the client's
first token and first audio. Compare with `engines_alone --streaming` and
`process_floor` (the same engines with nothing between them, or Redis lists alone).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness.procs import Deployment
from benchmarks.harness.redis import redis_for_run
from benchmarks.peers.load import prompt_tokens
from benchmarks.ttfp import OMNI, THINK_MAX_S
from omni_runtime.client import OmniClient
from omni_runtime.observe.tracing import read_trace_file
from omni_runtime.pipeline import load_pipeline

WARM_UP = 3
FIRST_TOKEN, FIRST_AUDIO = "first token (client)", "first audio (client)"


async def timelines(url: str, n: int, conc: int, trace: Path) -> dict[str, list[float]]:
    """Per point, its time after each counted request's `submit` call began (ms)."""
    d = Deployment(url, OMNI, f"first-{os.getpid()}", mode="streaming",
                   extra_env={"OMNI_TRACE_FILE": str(trace)}).start()  # fmt: skip
    prompt, _tokens = prompt_tokens()
    seen: dict[str, tuple[int, int, int]] = {}
    left = [WARM_UP + n]

    async def user(client: OmniClient, think: random.Random) -> None:
        while left[0] > 0:
            left[0] -= 1
            counted = left[0] < n
            await asyncio.sleep(think.uniform(0.0, THINK_MAX_S))
            t0 = time.monotonic_ns()
            rid = await client.submit(prompt)
            firsts: dict[int, int] = {}
            async for out in client.stream(rid, timeout_s=30):
                if out.error is not None:
                    raise RuntimeError(f"stage {out.stage_id}: {out.error}")
                heard = out.stage_id != 0 and out.data is not None and len(out.data) > 0
                if (out.stage_id == 0 or heard) and out.stage_id not in firsts:
                    firsts[out.stage_id] = time.monotonic_ns()
            if counted:
                seen[rid] = (t0, firsts[0], firsts[2])

    try:
        await d.wait_ready()
        settings = d.settings.model_copy(update={"trace_file": trace})
        async with OmniClient(settings, outputs=load_pipeline(OMNI).outputs) as client:
            await asyncio.gather(*(user(client, random.Random(i)) for i in range(conc)))
    finally:
        d.stop()
    stamps: dict[str, dict[str, int]] = {}
    for event, rid, stage, t_ns in read_trace_file(trace):
        name = event if stage is None else f"{event} {stage}"
        stamps.setdefault(rid, {}).setdefault(name, t_ns)
    points: dict[str, list[float]] = {}
    for rid, (t0, token, audio) in seen.items():
        for name, t_ns in (
            *stamps.get(rid, {}).items(),
            (FIRST_TOKEN, token),
            (FIRST_AUDIO, audio),
        ):
            points.setdefault(name, []).append((t_ns - t0) / 1e6)
    return points


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--conc", type=int, default=1, help="users at once (each thinks, then asks)")
    p.add_argument("--redis-url")
    args = p.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="omni-first-audio-") as tmp,
        redis_for_run(args.redis_url) as url,
    ):
        points = asyncio.run(timelines(url, args.n, args.conc, Path(tmp) / "trace.log"))
    print(f"streaming, {args.conc} user(s), {args.n} requests: p50 ms after submit()")
    for name, values in sorted(points.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"  {name:28s} {statistics.median(values):8.2f}")


if __name__ == "__main__":
    main()
