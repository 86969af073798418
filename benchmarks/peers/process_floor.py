"""The omni demo's engines each in a process of its own, joined by Redis lists and nothing
else: the least any runtime does that runs each stage in its own process over Redis,
beside omni-runtime streaming on the same load, in one run.

`python -m benchmarks.peers.process_floor [--conc 1,8,32] [--n 24,96,96] [--rounds 2]
[--redis-url URL]` starts three stage processes (`--stage NAME`: one thread that steps
its engine with `workers/omni.yaml`'s pacing, fed by a thread that pops its input list
(BLMPOP) and emptied by one that pushes each step's outputs to the next stage's list and
to the request's client list in one pipelined round trip, msgpack-encoded) and a
streaming deployment of `workers/omni.yaml`. Per concurrency and round, the cells
alternate: the floor, then omni-runtime, each `load.closed_loop` (the peers benchmark's
users, think times and checks; the client is this process). Prints per cell TTFA and
E2E p50 (p99) and CPU per request of every process of each (the stages or the
orchestrator and workers, this process, redis-server), with omni-runtime / floor per
round, then each process's share.

No durability, routing, recovery, validation or limits: a stage that dies loses its
requests. What the runtime adds over this is the price of those. Needs Redis 7 or later
(BLMPOP).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import statistics
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import msgpack
import numpy as np
import redis
import redis.asyncio as aredis

from benchmarks.harness.cpu import CpuSampler
from benchmarks.harness.procs import Deployment, watched
from benchmarks.harness.redis import delete_keys, redis_for_run, server_pid
from benchmarks.peers.__main__ import omni_source
from benchmarks.peers.load import ONE_REQUEST_S, Samples, closed_loop
from benchmarks.ttfp import AUDIO_STAGE, OMNI, TEXT_STAGE
from omni_runtime.client import OmniClient
from omni_runtime.pipeline import load_pipeline
from omni_runtime.stage_api import ChunkStream, EngineOutput
from workers.omni import Code2Wav, Talker, Thinker

STAGES = ("thinker", "talker", "code2wav")
PREFIX = "floor"
IDLE_WAIT_S = 1


def _in(stage: str) -> str:
    return f"{PREFIX}:in:{stage}"


def _out(rid: str) -> str:
    return f"{PREFIX}:out:{rid}"


def _engine(stage: str) -> Any:
    """`workers/omni.yaml`'s engines and pacing, as `engines_alone` steps them."""
    if stage == "thinker":
        return Thinker(20)
    return Talker(2) if stage == "talker" else Code2Wav(16000, 20, 50)


def _wire(data: Any) -> Any:
    return data.astype(np.float32).tobytes() if isinstance(data, np.ndarray) else data


def serve_stage(stage: str, url: str) -> None:
    """One stage's process: a thread that pops its inputs, one that steps the engine, one
    that pushes each step's outputs, so neither round trip holds the next step back."""
    engine = _engine(stage)
    index = STAGES.index(stage)
    following = _in(STAGES[index + 1]) if index + 1 < len(STAGES) else None
    to_client = stage in ("thinker", "code2wav")
    inbox: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
    outbox: queue.SimpleQueue[list[EngineOutput]] = queue.SimpleQueue()

    def read() -> None:
        r = redis.Redis.from_url(url)
        while True:
            got = r.blmpop(IDLE_WAIT_S, 1, _in(stage), direction="LEFT", count=512)
            if got:
                inbox.put(cast(list[bytes], got[1]))

    def send() -> None:
        r = redis.Redis.from_url(url)
        while True:
            outs = outbox.get()
            while not outbox.empty():
                outs += outbox.get()
            lists: dict[str, list[bytes]] = {}
            for out in outs:
                data = _wire(out.data)
                if following is not None:
                    item = msgpack.packb([out.request_id, data, out.finished])
                    lists.setdefault(following, []).append(item)
                if to_client:
                    item = msgpack.packb([index, data, out.finished])
                    lists.setdefault(_out(out.request_id), []).append(item)
            pipe = r.pipeline(transaction=False)
            for key, items in lists.items():  # one RPUSH a list: its reader pops them at once
                pipe.rpush(key, *items)
            pipe.execute()

    for work in (read, send):
        threading.Thread(target=work, daemon=True).start()
    streams: dict[str, ChunkStream] = {}
    print("ready", flush=True)
    while True:
        block = not engine.has_work()
        try:
            while True:
                for item in inbox.get(block=block):
                    rid, data, finished = msgpack.unpackb(item)
                    if stage == "thinker":
                        engine.add_request(rid, data)
                        continue
                    if rid not in streams:
                        streams[rid] = ChunkStream()
                        engine.add_request(rid, streams[rid])
                    streams[rid].extend([] if data is None else [data], closed=finished)
                    if finished:
                        del streams[rid]
                block = False
        except queue.Empty:
            pass
        if engine.has_work():
            outbox.put(engine.step())


def floor_source(client: aredis.Redis) -> Any:
    async def stream(prompt: str) -> AsyncIterator[tuple[int, Any]]:
        rid = uuid.uuid4().hex
        await client.rpush(_in("thinker"), msgpack.packb([rid, prompt, True]))
        while True:
            got = await client.blmpop(30, 1, _out(rid), direction="LEFT", count=512)
            if got is None:
                raise TimeoutError(f"no output of {rid} in 30 s")
            for item in got[1]:
                index, data, finished = msgpack.unpackb(item)
                if index == TEXT_STAGE:
                    if data is not None:
                        yield TEXT_STAGE, data
                    continue
                yield AUDIO_STAGE, np.frombuffer(data or b"", dtype=np.float32)
                if finished:
                    return

    return stream


class Floor:
    """The three stage processes, up until `stop`."""

    def __init__(self, url: str) -> None:
        self.url = url
        command = [sys.executable, "-m", "benchmarks.peers.process_floor", "--redis-url", url]
        self.procs = {
            s: subprocess.Popen([*command, "--stage", s], stdout=subprocess.PIPE) for s in STAGES
        }
        for s, p in self.procs.items():
            assert p.stdout is not None
            if p.stdout.readline().strip() != b"ready":
                self.stop()
                raise RuntimeError(f"stage {s} did not start (exit {p.poll()})")

    def pids(self) -> dict[str, int]:
        return {s: p.pid for s, p in self.procs.items()}

    def stop(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            p.wait(10)
        delete_keys(self.url, f"{PREFIX}:*")  # a shared Redis keeps none of the floor's lists


async def cell(
    name: str, run: Any, pids: dict[str, int], conc: int, n: int
) -> tuple[Samples, dict[str, float]]:
    """One closed loop; its samples and the CPU ms per request of each of `pids`."""
    sampler = CpuSampler(pids)
    sampler.start()
    samples: Samples = await run(conc, n)
    used = sampler.stop()
    if samples.errors:
        raise RuntimeError(f"{name}, c={conc}: {samples.errors[:3]}")
    return samples, {k: v * 1e3 / max(1, samples.done) for k, v in used.items() if k in pids}


async def measure(url: str, concs: list[int], ns: list[int], rounds: int) -> None:
    floor = Floor(url)
    omni = Deployment(url, OMNI, f"floor-{os.getpid()}", mode="streaming").start()
    common = {"client": os.getpid()} | (
        {"redis-server": pid} if (pid := server_pid(url)) is not None else {}
    )
    try:
        await omni.wait_ready()
        outputs = load_pipeline(OMNI).outputs
        async with (
            OmniClient(omni.settings, outputs=outputs) as oc,
            aredis.Redis.from_url(url, max_connections=128) as fc,
        ):

            async def run_floor(conc: int, n: int) -> Samples:
                return await closed_loop(floor_source(fc), conc, n)

            async def run_omni(conc: int, n: int) -> Samples:
                timeout_s = ONE_REQUEST_S * 4 * -(-n // conc) + 60
                return await watched([omni], closed_loop(omni_source(oc), conc, n), timeout_s)

            systems = {
                "floor": (run_floor, floor.pids() | common),
                "omni-runtime": (run_omni, omni.pids() | common),
            }
            for run, _pids in systems.values():  # warm-up
                await run(2, 4)
            by_process: dict[int, dict[str, dict[str, float]]] = {}
            print("| c | system | TTFA p50 (p99) | E2E p50 (p99) | CPU ms / request |")
            print("| --- | --- | --- | --- | --- |")
            for conc, n in zip(concs, ns, strict=True):
                got: dict[str, list[tuple[Samples, dict[str, float]]]] = {s: [] for s in systems}
                for _ in range(rounds):
                    for name, (run, pids) in systems.items():
                        got[name].append(await cell(name, run, pids, conc, n))
                for name, cells in got.items():
                    cpu_ms = statistics.median(sum(c.values()) for _s, c in cells)
                    print(f"| {conc} | {name} | {_figure(cells, 'ttfa', 1)} | "
                          f"{_figure(cells, 'e2e', 0)} | {cpu_ms:.0f} |", flush=True)  # fmt: skip
                pairs = list(zip(got["omni-runtime"], got["floor"], strict=True))
                ttfa = ", ".join(f"+{_p50(o) - _p50(f):.1f}" for (o, _), (f, _) in pairs)
                cpu = ", ".join(
                    f"{sum(o.values()) / sum(f.values()):.2f}x" for (_, o), (_, f) in pairs
                )
                print(f"|   | omni-runtime against the floor, per round | TTFA p50 {ttfa} ms | "
                      f"| CPU {cpu} |", flush=True)  # fmt: skip
                by_process[conc] = {s: _by_process(cells) for s, cells in got.items()}
            for conc, systems_cpu in by_process.items():
                for name, per in systems_cpu.items():
                    shares = ", ".join(f"{k} {v:.0f}" for k, v in per.items())
                    print(f"CPU ms / request by process, c={conc}, {name}: {shares}")
    finally:
        omni.stop()
        floor.stop()


def _p50(samples: Samples) -> float:
    return samples.p("ttfa", 50) or 0.0


def _by_process(cells: list[tuple[Samples, dict[str, float]]]) -> dict[str, float]:
    """Each process's median over the rounds, largest first."""
    names = {k for _s, c in cells for k in c}
    per = {k: statistics.median(c.get(k, 0.0) for _s, c in cells) for k in names}
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def _figure(cells: list[tuple[Samples, dict[str, float]]], metric: str, digits: int) -> str:
    """Median over the rounds of each round's p50 (p99)."""
    p50 = statistics.median(s.p(metric, 50) or 0.0 for s, _c in cells)
    p99 = statistics.median(s.p(metric, 99) or 0.0 for s, _c in cells)
    return f"{p50:.{digits}f} ({p99:.{digits}f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conc", default="1,8,32")
    p.add_argument("--n", default="24,96,96")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--redis-url")
    p.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage:
        serve_stage(args.stage, args.redis_url)
        return
    concs = [int(c) for c in args.conc.split(",")]
    ns = [int(n) for n in args.n.split(",")]
    with redis_for_run(args.redis_url) as url:
        asyncio.run(measure(url, concs, ns, args.rounds))


if __name__ == "__main__":
    main()
