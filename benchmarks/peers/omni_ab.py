"""The omni-runtime cells of `benchmarks.peers`, for two versions of the runtime side by side.

`python -m benchmarks.peers.omni_ab OTHER_CHECKOUT [--rounds 4] [--conc 1,32] [--n 16,96]
[--metrics]`
deploys both modes of `workers/omni.yaml` from this checkout and from OTHER_CHECKOUT
(a source tree, e.g. `git archive main | tar -x -C /tmp/omni-main`), all four up at once
on one private redis-server, and runs each cell (mode x concurrency, `load.closed_loop`,
the peers benchmark's load) for both versions back to back, the order flipped each round,
so a load that comes and goes falls on both alike. Prints per cell and version the median
over the rounds of the p50 TTFT, TTFA, E2E and thinker step period (ms), and the median
and range of the same-round ratio this / other for each. The client is this process.
`--metrics`: every process serves `/metrics`, as a production deployment does (metrics cost
the loops work per output that the default run leaves out).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

from benchmarks.harness.procs import Deployment, watched
from benchmarks.harness.redis import redis_for_run
from benchmarks.peers.__main__ import omni_source
from benchmarks.peers.load import ONE_REQUEST_S, STEP, Samples, closed_loop
from benchmarks.ttfp import OMNI
from omni_runtime.client import OmniClient
from omni_runtime.pipeline import load_pipeline

MODES = ("sequential", "streaming")
FIGURES = ("ttft", "ttfa", "e2e", STEP)
METRICS_PORT = 19500


async def cell(d: Deployment, conc: int, n: int) -> Samples:
    async with OmniClient(d.settings, outputs=load_pipeline(OMNI).outputs) as client:
        timeout_s = ONE_REQUEST_S * 4 * -(-n // conc) + 60
        return await watched([d], closed_loop(omni_source(client), conc, n), timeout_s)


async def main_async(args: argparse.Namespace, url: str) -> None:
    here = Path(__file__).resolve().parents[2]
    versions = {"this": here, "other": Path(args.other).resolve()}
    deps: dict[tuple[str, str], Deployment] = {}
    for v, root in versions.items():
        for m in MODES:
            port = METRICS_PORT + 10 * len(deps)  # stage k's worker serves on port + 1 + k
            env = {"OMNI_METRICS_PORT": str(port)} if args.metrics else None
            d = Deployment(url, OMNI, f"ab-{v}-{m[:3]}", mode=m, extra_env=env)
            d.env["PYTHONPATH"] = str(root)  # (the group shares this dict)
            deps[v, m] = d.start()
    try:
        for d in deps.values():
            await d.wait_ready()
        for d in deps.values():  # warm-up
            await cell(d, 2, 4)
        concs = [int(c) for c in args.conc.split(",")]
        ns = [int(n) for n in args.n.split(",")]
        got: dict[tuple[str, int, str], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            order = list(versions) if r % 2 == 0 else list(versions)[::-1]
            for conc, n in zip(concs, ns, strict=True):
                for m in MODES:
                    for v in order:
                        s = await cell(deps[v, m], conc, n)
                        p50 = {f: s.p(f, 50) or 0.0 for f in FIGURES}
                        p50["errors"] = len(s.errors)
                        got.setdefault((m, conc, v), []).append(p50)
                        print(
                            f"round {r} {m:<10} c={conc:<3} {v:<5} "
                            + " ".join(f"{f}={p50[f]:.1f}" for f in (*FIGURES, "errors")),
                            flush=True,
                        )
        print("\nmedian over rounds of p50 (ms); this/other: median [min-max] of same-round ratios")
        for conc in concs:
            for m in MODES:
                this, other = got[m, conc, "this"], got[m, conc, "other"]
                cols = []
                for f in FIGURES:
                    a = statistics.median(x[f] for x in this)
                    b = statistics.median(x[f] for x in other)
                    ratios = [x[f] / y[f] for x, y in zip(this, other, strict=True) if y[f]]
                    rr = f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
                    cols.append(f"{f} {a:.1f}/{b:.1f} {rr}")
                print(f"{m:<10} c={conc:<3} " + " | ".join(cols))
    finally:
        for d in deps.values():
            d.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("other")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--conc", default="1,32")
    p.add_argument("--n", default="16,96")
    p.add_argument("--redis-url")
    p.add_argument("--metrics", action="store_true", help="every process serves /metrics")
    args = p.parse_args()
    with redis_for_run(args.redis_url) as url:
        asyncio.run(main_async(args, url))


if __name__ == "__main__":
    main()
