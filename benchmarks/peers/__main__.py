"""omni-runtime against Ray Serve on the same work: the omni demo, sequential and streaming.

`python -m benchmarks.peers [--quick] [--profile] [--per-chunk]`. Both modes of
`workers/omni.yaml` run as omni-runtime deployments (processes, as `benchmarks/ttfp.py`
starts them; the client is an `OmniClient` in this process), and the same three engines
with the same options run as Ray Serve deployments (`ray_serve.py`: one replica each;
the client is a `DeploymentHandle` in a driver process of its own, `ray_driver.py`).
All four are up at once; per concurrency (1, 8, 32, 64) the cells alternate: omni
sequential, Ray sequential, omni streaming, Ray streaming, each the same closed loop
(`load.py`: users with think times, every request checked). Reported per cell: TTFT,
TTFA and E2E p50 (p99), requests/s, continuity (share of requests with no audio gap over
100 ms; worst gap p50/p99), and CPU per request of every process of the system:
omni-runtime's orchestrator, workers, client and redis-server; Ray's driver and every
process under it (GCS, raylet, agents, Serve controller, the mode's replicas; not the
idle replicas of its other applications), from `/proc`. Rows: omni-runtime / Ray, same
mode, with their targets (`report.py`).

`--profile` then samples both systems' Python processes with py-spy over a few more
cells (`profiles.py`: streaming at c = 1 and 32, sequential at 32). `--per-chunk` adds
Ray's other streaming composition (`ray_serve.py`) at every concurrency, against
omni-runtime streaming, without targets.

Ray is optional: `pip install -e '.[peers]'`. Without it this says so and exits 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from benchmarks.harness import scenario
from benchmarks.harness.cpu import CpuSampler, process_tree
from benchmarks.harness.procs import Deployment, RoleProc, role_env, watched
from benchmarks.harness.redis import server_pid
from benchmarks.harness.report import Row
from benchmarks.peers.load import ONE_REQUEST_S, Samples, closed_loop
from benchmarks.peers.profiles import profile_cells
from benchmarks.peers.report import OMNI_SYS, RAY_SYS, Cell, cell_table, rows
from benchmarks.ttfp import OMNI, Sizes
from omni_runtime.client import OmniClient
from omni_runtime.pipeline import load_pipeline

MODES = ("sequential", "streaming")
FULL = Sizes(concurrencies=(1, 8, 32, 64), rounds=3, min_requests=96, warmup=4)
QUICK = Sizes(concurrencies=(1, 8, 32), rounds=2, min_requests=32, warmup=2, max_rounds=4)
INSTALL_HINT = "Ray Serve is not installed: pip install -e '.[peers]' (or pip install 'ray[serve]')"
PROFILE = "--profile" in sys.argv
PER_CHUNK = "--per-chunk" in sys.argv
OWN_FLAGS = ("--profile", "--per-chunk")


def omni_source(client: OmniClient) -> Any:
    async def stream(prompt: str) -> AsyncIterator[tuple[int, Any]]:
        rid = await client.submit(prompt)
        async for out in client.stream(rid, timeout_s=30):
            if out.error is not None:
                raise RuntimeError(f"stage {out.stage_id}: {out.error}")
            yield out.stage_id, out.data

    return stream


@contextlib.asynccontextmanager
async def warm_omni_demo(
    url: str, mode: str, tag: str
) -> AsyncIterator[tuple[Any, dict[str, int]]]:
    """The omni demo deployed on `url` and warmed up: (its load source, pid of each of its
    processes: the workers, the orchestrator, this process as its client, redis-server)."""
    d = Deployment(url, OMNI, f"{tag}-{os.getpid()}", mode=mode).start()
    try:
        await d.wait_ready()
        async with OmniClient(d.settings, outputs=load_pipeline(OMNI).outputs) as client:
            source = omni_source(client)
            await closed_loop(source, 2, 4)  # warm-up
            pids = {**d.pids(), "client": os.getpid()}
            if (redis_pid := server_pid(url)) is not None:
                pids["redis-server"] = redis_pid
            yield source, pids
    finally:
        d.stop()


class Systems:
    """Both systems up at once: the two omni deployments and the Ray driver."""

    def __init__(self, ctx: scenario.Context) -> None:
        self.omni = {m: Deployment(ctx.redis_url, OMNI, f"peers-{m[:3]}", mode=m) for m in MODES}
        self.ctx = ctx
        self.ray: RoleProc | None = None
        self.redis_pid = server_pid(ctx.redis_url)

    async def start(self) -> None:
        for d in self.omni.values():
            d.start()
        ray_modes = [*MODES, *(["per-chunk"] * PER_CHUNK)]
        self.ray = RoleProc("ray-driver", "benchmarks.peers.ray_driver", ray_modes,
                            role_env(self.ctx.redis_url), self.ctx.log_dir)  # fmt: skip
        for d in self.omni.values():
            await d.wait_ready()
        ready = self.ray.recv(300)
        print(f"  Ray Serve deployed in {ready['deploy_s']:.1f} s", flush=True)

    def stop(self) -> None:
        if self.ray is not None:
            self.ray.stop(60)
        for d in self.omni.values():
            d.stop()

    def omni_pids(self, mode: str) -> dict[str, int]:
        pids = self.omni[mode].pids() | {"client": os.getpid()}
        if self.redis_pid is not None:
            pids["redis-server"] = self.redis_pid
        return pids

    def ray_pids(self) -> dict[str, int]:
        assert self.ray is not None
        return process_tree(self.ray.pid)

    async def run_omni(self, mode: str, conc: int, n: int) -> Samples:
        outputs = load_pipeline(OMNI).outputs
        async with OmniClient(self.omni[mode].settings, outputs=outputs) as client:
            timeout_s = ONE_REQUEST_S * 4 * -(-n // conc) + 60
            return await watched(list(self.omni.values()),
                                 closed_loop(omni_source(client), conc, n), timeout_s)  # fmt: skip

    def run_ray(self, mode: str, conc: int, n: int) -> Samples:
        assert self.ray is not None
        return ray_loop(self.ray, mode, conc, n)

    async def cell(self, system: str, mode: str, conc: int, n: int) -> Cell:
        ray = self.ray_pids()
        if system == OMNI_SYS:
            own, other = self.omni_pids(mode), ray
        else:  # Ray's other applications idle meanwhile, as the other omni deployment does
            own = {k: v for k, v in ray.items() if _ray_process_of(k, mode)}
            other = {f"{m} {k}": v for m in MODES for k, v in self.omni_pids(m).items()}
        sampler, idle = CpuSampler(own), CpuSampler(other)
        sampler.start()
        idle.start()
        if system == OMNI_SYS:
            samples = await self.run_omni(mode, conc, n)
        else:
            samples = await asyncio.to_thread(self.run_ray, mode, conc, n)
        cell = Cell(system, mode, conc, samples, sampler.stop(), load=os.getloadavg()[0])
        cell.other_idle_s = sum(v for k, v in idle.stop().items() if k in other)
        return cell


def ray_loop(driver: RoleProc, mode: str, conc: int, n: int) -> Samples:
    """One closed loop of the Ray driver (`ray_driver.py`) against its `mode` application."""
    driver.send({"mode": mode, "concurrency": conc, "n": n})
    timeout_s = ONE_REQUEST_S * 8 * -(-n // conc) + 120
    return Samples.from_json(driver.recv(timeout_s)["samples"])


def _ray_process_of(name: str, mode: str) -> bool:
    """Whether a Ray process counts for a cell of `mode`: every one but the replicas of
    Ray's other applications (its GCS, raylet, agents and controller serve any)."""
    return not name.startswith("ray::ServeReplica:") or name.startswith(
        f"ray::ServeReplica:{mode}:"
    )


async def measure(ctx: scenario.Context, sizes: Sizes) -> tuple[list[Cell], list[Row]]:
    systems = Systems(ctx)
    try:
        await systems.start()
        for mode in MODES:  # warm-up: imports, connections, thread pools, Ray's workers
            await systems.run_omni(mode, 2, sizes.warmup)
            await asyncio.to_thread(systems.run_ray, mode, 2, sizes.warmup)
        cells = []
        for conc in sizes.concurrencies:
            n = sizes.requests(conc)
            for mode in MODES:
                for system in (OMNI_SYS, RAY_SYS):
                    cell = await systems.cell(system, mode, conc, n)
                    print(f"  {system:<12} {mode:<10} c={conc:<3} {n} requests, "
                          f"{len(cell.samples.errors)} errors, load average {cell.load:.1f}",
                          flush=True)  # fmt: skip
                    cells.append(cell)
            if PER_CHUNK:
                cells.append(await systems.cell(RAY_SYS, "per-chunk", conc, n))
        profile_rows = await profile_cells(systems, ctx) if PROFILE else []
        return cells, profile_rows
    finally:
        systems.stop()


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    cells, profile_rows = asyncio.run(measure(ctx, sizes))
    print("\nLatency, ms: p50 (p99)\n" + cell_table(cells) + "\n")
    return rows(cells) + profile_rows


def main() -> int:
    if importlib.util.find_spec("ray") is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    argv = [a for a in sys.argv[1:] if a not in OWN_FLAGS]
    started = time.perf_counter()
    code = scenario.main("peers", __doc__, run, FULL, QUICK, argv)
    print(f"peers: {time.perf_counter() - started:.0f} s in all")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
