"""CPU per request of each process of the omni demo, for two versions of the runtime.

`python -m benchmarks.peers.cpu_ab OTHER_CHECKOUT [--rounds 3] [--mode streaming]
[--conc 1] [--n 20]` runs one cell (mode x concurrency, `load.closed_loop`, the peers
benchmark's load) of `workers/omni.yaml` on a private redis-server, once per version and
round, the order flipped each round. Each run is a process of its own whose imports come
from that version (the load client too, as it is one of the runtime's processes). Per
process: on-CPU ns of all its threads (`/proc/<pid>/task/*/schedstat`) over the cell,
per request. This VM's speed drifts between runs, so the same-round ratio this / other
is given for each process and the total, as well as each one's share of the total.

`--side-by-side` runs both versions' cells at once instead, each on a redis-server of its
own (swapped each round): the drift then falls on both alike, and the same-round ratios
of unchanged processes stay within a few per cent (one after the other: 0.6-1.1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


async def cell(url: str, mode: str, conc: int, n: int) -> dict[str, float]:
    """CPU ms per request of each process, one cell, in this process's version. It runs in
    the other version's tree too, so it imports only what every version has (it deploys by
    hand what `__main__.warm_omni_demo` does)."""
    from benchmarks.harness.cpu import proc_cpu_ns
    from benchmarks.harness.procs import Deployment
    from benchmarks.harness.redis import server_pid
    from benchmarks.peers.__main__ import omni_source
    from benchmarks.peers.load import closed_loop
    from benchmarks.ttfp import OMNI
    from omni_runtime.client import OmniClient
    from omni_runtime.pipeline import load_pipeline

    d = Deployment(url, OMNI, f"cpu-{os.getpid()}", mode=mode).start()
    try:
        await d.wait_ready()
        async with OmniClient(d.settings, outputs=load_pipeline(OMNI).outputs) as client:
            await closed_loop(omni_source(client), 2, 4)  # warm-up
            pids = {**d.pids(), "client": os.getpid()}
            if (redis_pid := server_pid(url)) is not None:
                pids["redis-server"] = redis_pid
            before = {name: proc_cpu_ns(pid) for name, pid in pids.items()}
            await closed_loop(omni_source(client), conc, n)
            after = {name: proc_cpu_ns(pid) for name, pid in pids.items()}
    finally:
        d.stop()
    per = {}
    for name in pids:
        start, end = before[name], after[name]
        if start is not None and end is not None:
            per[name.rsplit("-", 1)[0] if name.startswith("stage") else name] = (
                (end - start) / 1e6 / n
            )
    return per


def start_version(root: Path, url: str, args: argparse.Namespace) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, str(HERE), "--cell", url, args.mode, str(args.conc), str(args.n)]
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, text=True)


def cell_result(proc: subprocess.Popen[str]) -> dict[str, float]:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"a cell failed (exit {proc.returncode})")
    per = dict(json.loads(out.strip().splitlines()[-1]))
    per["total"] = sum(per.values())
    return per


def rounds(
    versions: dict[str, Path], urls: list[str], args: argparse.Namespace
) -> Iterator[dict[str, dict[str, float]]]:
    """Each round's CPU per request of each version: one after the other on `urls[0]`
    (the order flipped each round), or at once, each on a server of its own."""
    for r in range(args.rounds):
        order = list(versions) if r % 2 == 0 else list(versions)[::-1]
        if args.side_by_side:
            procs = {v: start_version(versions[v], urls[i], args) for i, v in enumerate(order)}
            yield {v: cell_result(proc) for v, proc in procs.items()}
        else:
            yield {v: cell_result(start_version(versions[v], urls[0], args)) for v in order}


def main() -> None:
    if sys.argv[1:2] == ["--cell"]:
        url, mode, conc, n = sys.argv[2:6]
        print(json.dumps(asyncio.run(cell(url, mode, int(conc), int(n)))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("other")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mode", default="streaming")
    p.add_argument("--conc", type=int, default=1)
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--redis-url")
    p.add_argument("--side-by-side", action="store_true", help="both versions at once")
    args = p.parse_args()
    from benchmarks.harness.redis import redis_for_run

    versions = {"this": HERE.parents[2], "other": Path(args.other).resolve()}
    got: dict[str, list[dict[str, float]]] = {v: [] for v in versions}
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(redis_for_run(args.redis_url))]
        if args.side_by_side:
            urls.append(stack.enter_context(redis_for_run(None)))
        for r, pers in enumerate(rounds(versions, urls, args)):
            for v, per in pers.items():
                got[v].append(per)
                print(f"round {r} {v:<5} " + ", ".join(f"{k} {x:.1f}" for k, x in per.items()))
    print(f"\n{args.mode} c={args.conc} n={args.n}: CPU ms per request, median over rounds "
          "(this / other); same-round ratio median [range]; share of the total this / other")  # fmt: skip
    for name in got["this"][0]:
        this = [x[name] for x in got["this"]]
        other = [x[name] for x in got["other"]]
        ratios = [a / b for a, b in zip(this, other, strict=True) if b]
        shares: list[Any] = [
            statistics.median(x[name] / x["total"] for x in got[v]) for v in versions
        ]
        print(
            f"  {name:<18} {statistics.median(this):7.1f} / {statistics.median(other):7.1f}  "
            f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]  "
            f"{shares[0]:.3f} / {shares[1]:.3f}"
        )


if __name__ == "__main__":
    main()
