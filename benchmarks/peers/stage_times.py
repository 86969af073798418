"""Where a peers cell's end-to-end time goes inside omni-runtime: one cell of the omni
demo with metrics on, the client's E2E beside the orchestrator's and each stage's queue
and run time (their means over the cell, from the processes' `/metrics`).

`python -m benchmarks.peers.stage_times [--mode sequential] [--conc 32] [--n 96]`. What the
stages' queue and run times do not cover is the orchestrator's hand-offs (its E2E minus
their sum) and the submission and delivery to the client (the client's E2E minus the
orchestrator's). Compare the run times with `engines_alone`'s floor.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import urllib.request

from benchmarks.harness.procs import Deployment
from benchmarks.harness.redis import redis_for_run
from benchmarks.peers.omni_ab import cell
from benchmarks.ttfp import OMNI

PORT = 19400
"""The orchestrator's metrics port; stage k's worker serves on PORT + 1 + k."""


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def mean_ms(before: str, after: str, name: str) -> tuple[float, int]:
    """A histogram's mean over the cell (ms) and its count, from two scrapes."""

    def get(text: str, suffix: str) -> float:
        m = re.search(rf"^{name}_{suffix}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    count = get(after, "count") - get(before, "count")
    total = get(after, "sum") - get(before, "sum")
    return 1e3 * total / max(count, 1), int(count)


async def measure(url: str, mode: str, conc: int, n: int) -> None:
    env = {"OMNI_METRICS_PORT": str(PORT)}
    d = Deployment(url, OMNI, "stage-times", mode=mode, extra_env=env).start()
    try:
        await d.wait_ready()
        await cell(d, 2, 4)  # warm-up
        procs = range(len(d.stage_ids) + 1)
        before = {i: scrape(PORT + i) for i in procs}
        samples = await cell(d, conc, n)
        after = {i: scrape(PORT + i) for i in procs}
    finally:
        d.stop()
    e2e = samples.ms["e2e"]
    print(f"{mode} c={conc}: client E2E p50 {samples.p('e2e', 50):.0f} ms, mean "
          f"{statistics.mean(e2e):.0f} over {len(e2e)} ({len(samples.errors)} errors)")  # fmt: skip
    orch, _ = mean_ms(before[0], after[0], "omni_e2e_request_latency_seconds")
    print(f"orchestrator E2E mean {orch:.0f} ms")
    total = 0.0
    for k in d.stage_ids:
        queue, _ = mean_ms(before[k + 1], after[k + 1], "omni_stage_queue_time_seconds")
        run, count = mean_ms(before[k + 1], after[k + 1], "omni_stage_run_time_seconds")
        total += queue + run
        print(f"stage {k}: queue {queue:.1f} ms, run {run:.1f} ms (mean over {count})")
    print(f"stages' queue + run {total:.0f} ms; orchestrator's hand-offs {orch - total:.0f} ms; "
          f"submission and delivery {statistics.mean(e2e) - orch:.0f} ms")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="sequential")
    p.add_argument("--conc", type=int, default=32)
    p.add_argument("--n", type=int, default=96)
    p.add_argument("--redis-url")
    args = p.parse_args()
    with redis_for_run(args.redis_url) as url:
        asyncio.run(measure(url, args.mode, args.conc, args.n))


if __name__ == "__main__":
    main()
