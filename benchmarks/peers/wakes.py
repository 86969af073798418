"""Wake-ups and CPU per wake-up of every thread of the omni demo, one cell of the peers load.

`python -m benchmarks.peers.wakes [--mode streaming] [--conc 1] [--n 20] [--pin ROLE]
[--redis-url URL]` deploys `workers/omni.yaml` as processes on a redis-server, warms it
up, then runs `load.closed_loop` (the peers benchmark's load) and counts, per thread of
the orchestrator, each worker, the client (this process) and redis-server, its
voluntary context switches (each a sleep, so a wake-up after it) and its on-CPU time
(`/proc/<pid>/task/<tid>/status` and `schedstat`), per request. `--pin ROLE` first pins
the processes whose name starts with ROLE to the last CPU and every other one to the
first (`taskset`): whether a process's cost per wake-up is its own cold path or the
other processes' work evicting its caches. Prints a table, writes
`benchmarks/results/wakes.json`.

Why: at one request in flight nothing batches, so a system's CPU per request is its
wake-ups times what each costs; the two call for different remedies (fewer hops or
sends, against less work per hop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.harness.redis import redis_for_run
from benchmarks.peers.__main__ import warm_omni_demo
from benchmarks.peers.load import closed_loop

RESULTS = Path(__file__).resolve().parents[1] / "results" / "wakes.json"

Threads = dict[str, tuple[int, int]]
"""tid → (voluntary context switches, on-CPU ns)."""


def threads(pid: int) -> Threads:
    out: Threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            on_cpu_ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just exited
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                out[task.name] = (int(line.split()[1]), on_cpu_ns)
    return out


def pin(pids: dict[str, int], role: str) -> None:
    last = os.cpu_count() or 1
    for name, pid in pids.items():
        cpu = last - 1 if name.startswith(role) else 0
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)],
                       check=True, capture_output=True)  # fmt: skip


async def measure(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    async with warm_omni_demo(url, args.mode, "wakes") as (source, pids):
        if args.pin:
            pin(pids, args.pin)
        before = {name: threads(pid) for name, pid in pids.items()}
        await closed_loop(source, args.conc, args.n)
        after = {name: threads(pid) for name, pid in pids.items()}
    rows = []
    for name in pids:
        for tid, (wakes_1, ns_1) in after[name].items():
            wakes_0, ns_0 = before[name].get(tid, (0, 0))
            wakes, cpu_ms = (wakes_1 - wakes_0) / args.n, (ns_1 - ns_0) / 1e6 / args.n
            if cpu_ms >= 0.5:  # the threads that work for requests, not the idle ones
                thread = "main" if tid == str(pids[name]) else f"thread {tid}"
                rows.append({"process": name, "thread": thread, "wakes": wakes, "cpu_ms": cpu_ms})
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n{args.mode} c = {args.conc}, {args.n} requests; per request:")
    print("| process | thread | wake-ups | CPU ms | µs per wake-up |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        per_wake = r["cpu_ms"] * 1e3 / max(r["wakes"], 1.0)
        print(f"| {r['process']} | {r['thread']} | {r['wakes']:.1f} | {r['cpu_ms']:.1f} "
              f"| {per_wake:.0f} |")  # fmt: skip
    wakes = sum(r["wakes"] for r in rows)
    cpu_ms = sum(r["cpu_ms"] for r in rows)
    print(f"| all | | {wakes:.0f} | {cpu_ms:.0f} | {cpu_ms * 1e3 / max(wakes, 1.0):.0f} |")
    return {"mode": args.mode, "concurrency": args.conc, "requests": args.n,
            "pinned": args.pin, "threads": rows}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="streaming")
    p.add_argument("--conc", type=int, default=1)
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--pin", help="pin processes named ROLE… to the last CPU, the rest to the first")
    p.add_argument("--redis-url")
    args = p.parse_args()
    with redis_for_run(args.redis_url) as url:
        rows = asyncio.run(measure(url, args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report(rows, args), indent=1))
    print(f"results written to {RESULTS}")


if __name__ == "__main__":
    main()
