"""CPU per request of omni-runtime and Ray Serve streaming, each with the other system
down, and each with the other up and idle (as `python -m benchmarks.peers` runs them).

`python -m benchmarks.peers.cpu_alone [--rounds 3] [--conc 1] [--n 24] [--redis-url URL]`.
A round holds four cells of `load.closed_loop` (the peers benchmark's load) on the
streaming composition of both: one system alone, the other started beside it, each of
them with the other idle, the first stopped, the second alone; the order of the systems
flips each round, so the machine's drift falls on both alike. Counted per cell, as the
peers benchmark counts them: omni-runtime's orchestrator, workers, client (this process)
and redis-server; every process of Ray's driver tree (one application, so no idle
replicas). Prints each round's CPU ms per request and the ratios omni-runtime / Ray
alone and beside, then each cell's per-process medians; writes them to
`benchmarks/results/cpu_alone.json`.

Why: an idle system still wakes (Ray's controller polls, its GCS and agents tick; an
omni-runtime deployment's workers renew leases), and on two cores what it wakes for
takes CPU time and caches from the system measured.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness.cpu import CpuSampler, process_tree
from benchmarks.harness.procs import Deployment, RoleProc, role_env
from benchmarks.harness.redis import redis_for_run, server_pid
from benchmarks.peers.__main__ import INSTALL_HINT, ray_loop
from benchmarks.peers.load import Samples
from benchmarks.peers.omni_ab import cell as omni_cell
from benchmarks.ttfp import OMNI

MODE = "streaming"
OMNI_SYS, RAY_SYS = "omni-runtime", "Ray Serve"
RESULTS = Path(__file__).resolve().parents[1] / "results" / "cpu_alone.json"
PerProcess = dict[str, float]


class Run:
    """One omni-runtime deployment and one Ray driver, each started and stopped at will."""

    def __init__(self, url: str, log_dir: Path, conc: int, n: int) -> None:
        self.url, self.log_dir, self.conc, self.n = url, log_dir, conc, n
        self.omni: Deployment | None = None
        self.ray: RoleProc | None = None
        self.redis_pid = server_pid(url)

    async def start(self, system: str) -> None:
        if system == OMNI_SYS:
            self.omni = Deployment(self.url, OMNI, f"alone-{os.getpid()}", mode=MODE).start()
            await self.omni.wait_ready()
            await self._omni_loop(2, 4)  # warm-up
        else:
            self.ray = RoleProc("ray-driver", "benchmarks.peers.ray_driver", [MODE],
                                role_env(self.url), self.log_dir)  # fmt: skip
            await asyncio.to_thread(self.ray.recv, 300)
            await asyncio.to_thread(self._ray_loop, 2, 4)

    def stop(self, system: str) -> None:
        if system == OMNI_SYS and self.omni is not None:
            self.omni.stop()
            self.omni = None
        elif system == RAY_SYS and self.ray is not None:
            self.ray.stop(60)
            self.ray = None

    async def cell(self, system: str) -> PerProcess:
        """CPU ms per request of each of `system`'s processes over one closed loop."""
        if system == OMNI_SYS:
            assert self.omni is not None
            pids = self.omni.pids() | {"client": os.getpid()}
            if self.redis_pid is not None:
                pids["redis-server"] = self.redis_pid
        else:
            assert self.ray is not None
            pids = process_tree(self.ray.pid)
        sampler = CpuSampler(pids)
        sampler.start()
        if system == OMNI_SYS:
            samples = await self._omni_loop(self.conc, self.n)
        else:
            samples = await asyncio.to_thread(self._ray_loop, self.conc, self.n)
        used = sampler.stop()
        if samples.errors:
            raise RuntimeError(f"{system}: {samples.errors[:3]}")
        per: PerProcess = {}
        for name, seconds in used.items():
            if name in pids:  # Ray's are named `<name> <pid>`: one name across rounds
                bare = name.rsplit(" ", 1)[0] if name.rsplit(" ", 1)[-1].isdigit() else name
                per[bare] = per.get(bare, 0.0) + seconds * 1e3 / samples.done
        return per

    async def _omni_loop(self, conc: int, n: int) -> Samples:
        assert self.omni is not None
        return await omni_cell(self.omni, conc, n)

    def _ray_loop(self, conc: int, n: int) -> Samples:
        assert self.ray is not None
        return ray_loop(self.ray, MODE, conc, n)


async def measure(url: str, rounds: int, conc: int, n: int) -> dict[str, list[PerProcess]]:
    """Per cell name (`<system> alone` / `<system> beside`), each round's per-process CPU."""
    got: dict[str, list[PerProcess]] = {}
    with tempfile.TemporaryDirectory(prefix="omni-cpu-alone-") as log_dir:
        run = Run(url, Path(log_dir), conc, n)
        try:
            for r in range(rounds):
                first, second = (OMNI_SYS, RAY_SYS) if r % 2 == 0 else (RAY_SYS, OMNI_SYS)
                await run.start(first)
                got.setdefault(f"{first} alone", []).append(await run.cell(first))
                await run.start(second)
                for system in (first, second):
                    got.setdefault(f"{system} beside", []).append(await run.cell(system))
                run.stop(first)
                got.setdefault(f"{second} alone", []).append(await run.cell(second))
                run.stop(second)
                print(f"  round {r + 1}: " + ", ".join(
                    f"{name} {sum(cells[-1].values()):.0f}" for name, cells in got.items()
                ), flush=True)  # fmt: skip
        finally:
            run.stop(OMNI_SYS)
            run.stop(RAY_SYS)
    return got


def report(got: dict[str, list[PerProcess]], conc: int) -> dict[str, Any]:
    totals = {name: [sum(c.values()) for c in cells] for name, cells in got.items()}
    ratios = {
        where: [o / r for o, r in zip(totals[f"{OMNI_SYS} {where}"], totals[f"{RAY_SYS} {where}"],
                                      strict=True)]
        for where in ("alone", "beside")
    }  # fmt: skip
    print(f"\nCPU ms per request, c = {conc}, {MODE}: each round, then the median")
    print("| cell | " + " | ".join(f"round {i + 1}" for i in range(len(ratios["alone"]))) +
          " | median |")  # fmt: skip
    rows = {**totals, **{f"omni-runtime / Ray, {w}": v for w, v in ratios.items()}}
    for name, values in rows.items():
        fmt = "{:.2f}x" if "/" in name else "{:.0f}"
        cells = [fmt.format(v) for v in (*values, statistics.median(values))]
        print(f"| {name} | " + " | ".join(cells) + " |")
    per_process = {
        name: {k: statistics.median(c.get(k, 0.0) for c in cells) for k in set().union(*cells)}
        for name, cells in got.items()
    }
    for name, per in per_process.items():
        top = sorted(per.items(), key=lambda kv: -kv[1])[:8]
        print(f"{name}, median by process: " + ", ".join(f"{k} {v:.0f}" for k, v in top))
    return {"concurrency": conc, "mode": MODE, "totals_ms": totals, "ratios": ratios,
            "per_process_ms": per_process}  # fmt: skip


def main() -> int:
    if importlib.util.find_spec("ray") is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--conc", type=int, default=1)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--redis-url")
    args = p.parse_args()
    with redis_for_run(args.redis_url) as url:
        got = asyncio.run(measure(url, args.rounds, args.conc, args.n))
    result = report(got, args.conc)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(f"results written to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
