"""End-to-end benchmark: the seed pipeline as real processes over a loopback redis-server.

Pipeline ``workers/seed.yaml`` (sequential, finals {0, 2}): an orchestrator process and one
worker process per stage, every run in its own ``OMNI_NAMESPACE``. Prompt ``"hi there"``: per
request stage 0 emits 2 outputs, stage 1 one, stage 2 two; the client gets 4 outputs (checked).

(1) Throughput. The processes are started exactly as ``omni-runtime run`` does
    (``ProcessGroup``). Load comes from client **processes** (this file, ``--role client``),
    each one ``OmniClient``: N requests with at most C in flight. Configurations: one client
    at C=64 and C=256, and two client processes sharing C=256, to show whether one client
    is the bottleneck. requests/s = N / (first submit -> last finished output), median over
    the repetitions; latency = submit -> finished output, p50/p99 over all requests of all
    repetitions. CPU of every process (``/proc/<pid>/stat``) and of the machine
    (``/proc/stat``) is sampled around every repetition; "other" is the machine's busy time
    not used by the named processes (kernel workers, this coordinator).

(2) Per-hop latency: "a stage output's arrival at the orchestrator -> the next stage's input
    read by its worker", at light load (one request at a time, the next one ~5 ms after the
    previous finished). The orchestrator runs in this process (``OrchestratorService`` on an
    asyncio loop in a thread) with instrumented subclasses patched into
    ``omni_runtime.orchestrator_proc`` for the run (routing logic untouched): a ``RedisStageClient``
    that stamps when a reply of the stage's output stream is in hand (before validation),
    when ``get_output`` returns and when ``submit`` is called; a ``StreamWriter`` that stamps
    the start and end of the pipeline carrying each stage input; and a ``read_group`` that
    stamps each read of the requests stream. Each worker is a subprocess (``--role
    stamped-worker``) whose ``InputReader.inject`` is patched to stamp every entry its
    XREADGROUP returned. All stamps are ``time.monotonic_ns`` (CLOCK_MONOTONIC: one clock for
    every process), correlated by request id. Hops S0->S1 and S1->S2 are reported alone and
    pooled, with their segments; the light-load request is also shown as a timeline.

    Baseline, in the same run, repetitions interleaved with the hop's: a raw one-way hand-off
    between two processes of their own (``--role raw-producer`` / ``raw-consumer``),
    redis-py ``XADD`` -> ``XREADGROUP BLOCK`` (consumer group, COUNT 100, XACK after),
    ~200 B msgpack messages spaced U(2, 4) ms, producer stamp just before the XADD, consumer
    stamp when XREADGROUP returned (research: redis_substrate §3a). A second variant
    produces from the orchestrator's own asyncio loop (redis.asyncio), to separate the
    asyncio client's cost from the orchestrator's logic. Ratio = hop p50 / raw (sync) p50.

Targets (issue): >= 1,000 requests/s end to end; per-hop p50 <= 2x the raw hand-off p50.

Run ``python benchmarks/bench_e2e.py [--quick] [--redis-url URL] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import queue
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import common
import msgpack
import redis
import redis.asyncio as aioredis
from common import (
    ROOT,
    TICK_S,
    Summary,
    base_parser,
    delete_keys,
    environment,
    format_table,
    git,
    percentile,
    proc_cpu_s,
    redis_or_private,
    redis_server_pid,
    stop_process,
    write_results,
)

from omni_runtime import keys
from omni_runtime.launcher import ProcessGroup, child_env
from omni_runtime.pipeline import PipelineConfig, load_pipeline
from omni_runtime.settings import Settings

SEED_PIPELINE = ROOT / "workers" / "seed.yaml"
DEFAULT_JSON = Path("benchmarks/results/bench_e2e.json")
PROMPT = "hi there"
EXPECTED = [(0, "hi", False), (0, "there", False), (2, "wav:HI", False), (2, "wav:THERE", True)]
TARGET_RPS = 1000.0
TARGET_HOP_RATIO = 2.0
RAW_PAD = os.urandom(160)  # + seq + stamp + framing ~ 200 B of msgpack
STARTUP_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
START_DELAY_NS = 100_000_000  # clients start together this long after the command is sent
MACHINE = "machine (all CPUs)"
OTHER = "other (kernel workers, this coordinator, ...)"
SHARED_MACHINE_FRACTION = 0.15
"""More "other" CPU than this (of one core) means something else ran on the machine."""


def load_deadline_s(n: int, concurrency: int, gap_ms: float) -> float:
    """Generous bound on one load run (~50 ms per request and slot); a hang fails, not waits."""
    return 60.0 + n * (1.2 * gap_ms / 1000 + 0.05) / max(1, concurrency)


# --- sizes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    reps: int
    requests: int
    """Requests per repetition of each throughput configuration."""
    warmup_requests: int
    load_configs: tuple[tuple[int, int], ...]
    """(client processes, total concurrency) per throughput configuration."""
    light_requests: int
    """Requests per repetition of the light-load hop measurement."""
    light_gap_ms: float
    raw_messages: int
    """Messages per repetition of each raw hand-off baseline."""


FULL = Sizes(
    reps=5,
    requests=2000,
    warmup_requests=300,
    load_configs=((1, 64), (1, 256), (2, 256)),
    light_requests=300,
    light_gap_ms=5.0,
    raw_messages=400,
)
QUICK = Sizes(
    reps=3,
    requests=500,
    warmup_requests=100,
    load_configs=((1, 64), (1, 256), (2, 256)),
    light_requests=100,
    light_gap_ms=5.0,
    raw_messages=150,
)


# --- rows ------------------------------------------------------------------------------------


@dataclass
class Row(common.Row):
    """A table row that also carries per-segment figures into the JSON file."""

    details: dict[str, Any] = field(default_factory=dict)


# --- child processes with a JSON-lines protocol -----------------------------------------------


class LineProc:
    """A child speaking JSON lines: commands on its stdin, results on its stdout."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float) -> dict[str, Any]:
        """The next JSON object the child prints; raises on timeout or exit (with its log)."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.0, remaining))
            except queue.Empty:
                raise TimeoutError(
                    f"{self.name}: no answer within {timeout_s:g} s\n{self.tail()}"
                ) from None
            if line is None:
                code = self.proc.wait(5)
                raise RuntimeError(f"{self.name} exited with code {code}\n{self.tail()}")
            if line.startswith("{"):
                result: dict[str, Any] = json.loads(line)
                if "error" in result:
                    raise RuntimeError(f"{self.name}: {result['error']}\n{self.tail()}")
                return result

    def tail(self, lines: int = 15) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(f"    {s}" for s in text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 3.0) -> None:
        """EOF on stdin ends an idle child's command loop; a busy or deaf one is terminated."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # EOF: the child's command loop ends
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                stop_process(self.proc)
        self._log.close()


def _role_cmd(role: str, *extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--role", role, *extra]


def _emit(obj: dict[str, Any]) -> None:
    """A child's answer to the coordinator: one JSON line on stdout."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# --- role: load client --------------------------------------------------------------------------


async def run_requests(
    client: Any,
    n: int,
    concurrency: int,
    gap_ms: float,
    tag: str,
    start_at_ns: int,
    timeline: bool = False,
) -> dict[str, Any]:
    """n requests of PROMPT, at most `concurrency` in flight; each slot waits ~gap_ms after.

    `timeline`: also return `{request id: [submit, finished]}` in monotonic ns.
    """
    delay_s = (start_at_ns - time.monotonic_ns()) / 1e9
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    slots = asyncio.Semaphore(concurrency)
    latencies_ns: list[int] = []
    errors: list[str] = []
    stamps: dict[str, list[int]] = {}

    async def one(i: int) -> None:
        async with slots:
            rid = f"{tag}-{i}"
            t0 = time.monotonic_ns()
            try:
                await client.submit(PROMPT, request_id=rid)
                outs = [
                    (o.stage_id, o.data, o.finished)
                    async for o in client.stream(rid, timeout_s=REQUEST_TIMEOUT_S)
                ]
            except Exception as e:  # counted, the run goes on
                errors.append(f"{rid}: {type(e).__name__}: {e}")
            else:
                t1 = time.monotonic_ns()
                latencies_ns.append(t1 - t0)
                if timeline:
                    stamps[rid] = [t0, t1]
                if outs != EXPECTED:
                    errors.append(f"{rid}: unexpected outputs {outs}")
            if gap_ms > 0:
                await asyncio.sleep(random.uniform(0.8, 1.2) * gap_ms / 1000)

    t_start = time.monotonic_ns()
    cpu0 = time.process_time()
    await asyncio.gather(*(one(i) for i in range(n)))
    t_end = time.monotonic_ns()
    return {
        "t_start_ns": t_start,
        "t_end_ns": t_end,
        "cpu_s": time.process_time() - cpu0,
        "latencies_ns": latencies_ns,
        "errors": errors[:20],
        "n_errors": len(errors),
        "timeline": stamps,
    }


async def _client_main(settings: Settings, stage_ids: list[int]) -> None:
    from omni_runtime.client import OmniClient

    loop = asyncio.get_running_loop()
    async with OmniClient(settings) as client:
        await client.wait_ready(stage_ids, timeout_s=STARTUP_TIMEOUT_S)
        _emit({"ready": True, "pid": os.getpid()})
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            if cmd.get("op") == "exit":
                return
            deadline_s = load_deadline_s(cmd["n"], cmd["concurrency"], cmd["gap_ms"])
            try:
                async with asyncio.timeout(deadline_s):
                    result = await run_requests(
                        client,
                        cmd["n"],
                        cmd["concurrency"],
                        cmd["gap_ms"],
                        cmd["tag"],
                        cmd["start_at_ns"],
                        cmd.get("timeline", False),
                    )
            except TimeoutError:
                _emit({"error": f"load did not finish within {deadline_s:g} s"})
                return
            _emit(result)


def client_role(args: argparse.Namespace) -> int:
    settings = Settings(redis_url=args.redis_url, namespace=args.namespace)
    asyncio.run(_client_main(settings, [int(s) for s in args.stages.split(",")]))
    return 0


def start_clients(
    count: int, redis_url: str, namespace: str, stage_ids: list[int], log_dir: Path
) -> list[LineProc]:
    """`count` client processes, each connected and seeing the whole pipeline ready."""
    procs: list[LineProc] = []
    try:
        for i in range(count):
            cmd = _role_cmd(
                "client",
                *("--redis-url", redis_url, "--namespace", namespace),
                *("--stages", ",".join(map(str, stage_ids))),
            )
            procs.append(LineProc(f"client{i}", cmd, child_env(redis_url), log_dir))
        for p in procs:
            p.recv(STARTUP_TIMEOUT_S + 10)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def run_load(
    clients: list[LineProc],
    n: int,
    concurrency: int,
    gap_ms: float,
    tag: str,
    timeline: bool = False,
    check_alive: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Split n requests and the concurrency over the clients; start them together.

    `check_alive` is called while waiting and should raise if a pipeline process died.
    """
    start_at = time.monotonic_ns() + START_DELAY_NS
    k = len(clients)
    for i, c in enumerate(clients):
        c.send(
            {
                "op": "load",
                "n": n // k + (i < n % k),
                "concurrency": max(1, concurrency // k),
                "gap_ms": gap_ms,
                "tag": f"{tag}c{i}",
                "start_at_ns": start_at,
                "timeline": timeline,
            }
        )
    deadline = time.monotonic() + load_deadline_s(n, concurrency, gap_ms) + 15
    results: list[dict[str, Any]] = []
    for c in clients:
        while True:  # wait in slices: a pipeline process that died fails the run at once
            try:
                results.append(c.recv(min(0.5, max(0.0, deadline - time.monotonic()))))
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                if check_alive is not None:
                    check_alive()
    return results


# --- role: instrumented worker ------------------------------------------------------------------


def stamped_worker_role(args: argparse.Namespace) -> int:
    """A normal stage worker whose input reader logs `request_id monotonic_ns` per entry read."""
    from omni_runtime import codec
    from omni_runtime.cli import main as cli_main
    from omni_runtime.redis_io.stage_client import Entry
    from omni_runtime.worker.io_threads import InputReader

    out = open(args.stamp_file, "a", buffering=1)  # noqa: SIM115 (lives as long as the process)
    original = InputReader.inject
    field_name = keys.PAYLOAD_FIELD.encode()

    def inject(self: InputReader, entries: list[Entry]) -> None:
        t = time.monotonic_ns()  # XREADGROUP returned these entries just now
        original(self, entries)  # hand over first: the stamp's bookkeeping is not in the hop
        for _eid, fields in entries:
            try:
                rid = codec.decode(fields[field_name])["request_id"]
            except Exception:
                continue
            out.write(f"{rid} {t}\n")

    InputReader.inject = inject  # type: ignore[method-assign]
    return cli_main(["worker", "--pipeline", args.pipeline, "--stage", str(args.stage)])


def read_worker_stamps(path: Path, prefix: str) -> dict[str, int]:
    stamps: dict[str, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rid, _, t = line.partition(" ")
            if rid.startswith(prefix) and t:
                stamps.setdefault(rid, int(t))  # first read wins (a redelivery is not the hop)
    return stamps


# --- role: raw hand-off consumer --------------------------------------------------------------


def raw_consumer_role(args: argparse.Namespace) -> int:
    """XREADGROUP BLOCK consumer; answers a "flush" entry with the latencies it saw."""
    client = redis.Redis.from_url(args.redis_url)
    stream, group = args.stream, "raw"
    with contextlib.suppress(redis.ResponseError):
        client.xgroup_create(stream, group, id="$", mkstream=True)
    _emit({"ready": True, "pid": os.getpid()})
    samples: list[int] = []
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            reply: Any = client.xreadgroup(group, "c", {stream: ">"}, count=100, block=100)
            t = time.monotonic_ns()
            for _s, entries in reply or []:
                for eid, fields in entries:
                    msg = msgpack.unpackb(fields[b"m"])
                    client.xack(stream, group, eid)
                    op = msg.get("op")
                    if op == "exit":
                        return 0
                    if op == "flush":
                        _emit({"samples_ns": samples})
                        samples = []
                    else:
                        samples.append(t - msg["t"])
    finally:
        client.close()
    return 1


def _raw_message(seq: int) -> bytes:
    packed: bytes = msgpack.packb({"seq": seq, "t": time.monotonic_ns(), "pad": RAW_PAD})
    return packed


def raw_produce_sync(url: str, stream: str, n: int) -> None:
    client = redis.Redis.from_url(url)
    try:
        for i in range(n):
            client.xadd(stream, {"m": _raw_message(i)}, maxlen=10_000, approximate=True)
            time.sleep(random.uniform(0.002, 0.004))
        client.xadd(stream, {"m": msgpack.packb({"op": "flush"})})
    finally:
        client.close()


def raw_producer_role(args: argparse.Namespace) -> int:
    """A process of its own (no other thread to share a GIL with) producing on command."""
    _emit({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") != "produce":
            break
        raw_produce_sync(args.redis_url, args.stream, cmd["n"])
        _emit({"done": True})
    return 0


async def raw_produce_async(url: str, stream: str, n: int) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        for i in range(n):
            await client.xadd(stream, {"m": _raw_message(i)}, maxlen=10_000, approximate=True)
            await asyncio.sleep(random.uniform(0.002, 0.004))
        await client.xadd(stream, {"m": msgpack.packb({"op": "flush"})})
    finally:
        await client.aclose()


# --- CPU accounting ---------------------------------------------------------------------------


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + parts[4]
    total = sum(parts[:8])
    return float(total - idle), float(total)


class CpuSampler:
    """CPU seconds each named process used between `start` and `stop`, plus the machine's."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def start(self) -> None:
        self.c0 = {name: proc_cpu_s(pid) for name, pid in self.pids.items()}
        self.m0 = machine_cpu()

    def stop(self) -> dict[str, float]:
        """CPU seconds per process; MACHINE: busy CPU seconds of all CPUs together."""
        m1 = machine_cpu()
        out: dict[str, float] = {}
        for name, pid in self.pids.items():
            c0, c1 = self.c0.get(name), proc_cpu_s(pid)
            if c0 is not None and c1 is not None:
                out[name] = c1 - c0
        out[MACHINE] = (m1[0] - self.m0[0]) * TICK_S
        out[OTHER] = out[MACHINE] - sum(v for k, v in out.items() if k != MACHINE)
        return out


# --- (1) end-to-end throughput ----------------------------------------------------------------


def _namespace(kind: str) -> str:
    return f"bench-e2e-{kind}-{uuid.uuid4().hex[:8]}"


def bench_throughput(sizes: Sizes, url: str, log_dir: Path) -> list[Row]:
    pipeline = load_pipeline(SEED_PIPELINE)
    namespace = _namespace("load")
    stage_ids = list(range(pipeline.last_stage + 1))
    group = ProcessGroup(SEED_PIPELINE, pipeline, child_env(url, {"OMNI_NAMESPACE": namespace}))
    clients: list[LineProc] = []
    rows: list[Row] = []
    try:
        group.start()
        clients = start_clients(
            max(k for k, _ in sizes.load_configs), url, namespace, stage_ids, log_dir
        )
        group.check_alive()
        pids = {name.split("-")[0]: proc.pid for name, proc, _f in group.procs}
        server_pid = redis_server_pid(url, names=("redis", "valkey"))
        if server_pid is not None:
            pids["redis-server"] = server_pid
        run_load(clients[:1], sizes.warmup_requests, 64, 0.0, "warm", check_alive=group.check_alive)
        for n_clients, concurrency in sizes.load_configs:
            active = clients[:n_clients]
            sampler = CpuSampler(pids | {f"client{i}": c.proc.pid for i, c in enumerate(active)})
            rates: list[float] = []
            latencies: list[int] = []
            errors: list[str] = []
            util: list[dict[str, float]] = []
            per_request_us: list[dict[str, float]] = []
            for rep in range(sizes.reps):
                gc.collect()
                sampler.start()
                results = run_load(
                    active,
                    sizes.requests,
                    concurrency,
                    0.0,
                    f"r{n_clients}x{concurrency}n{rep}",
                    check_alive=group.check_alive,
                )
                cpu_s = sampler.stop()
                group.check_alive()
                wall_s = (
                    max(r["t_end_ns"] for r in results) - min(r["t_start_ns"] for r in results)
                ) / 1e9
                done = sum(len(r["latencies_ns"]) for r in results)
                rates.append(done / wall_s)
                # the processes idle outside the load window: its CPU is all in the window
                util.append({name: v / wall_s for name, v in cpu_s.items()})
                per_request_us.append(
                    {
                        name: 1e6 * v / max(1, done)
                        for name, v in cpu_s.items()
                        if name not in (MACHINE, OTHER)
                    }
                )
                for r in results:
                    latencies.extend(r["latencies_ns"])
                    errors.extend(r["errors"])
            rows.append(
                _throughput_row(
                    sizes, n_clients, concurrency, rates, latencies, errors, util, per_request_us
                )
            )
    finally:
        for c in clients:
            c.stop()
        group.stop()
        delete_keys(url, f"{namespace}:*")
    return rows


def _throughput_row(
    sizes: Sizes,
    n_clients: int,
    concurrency: int,
    rates: list[float],
    latencies_ns: list[int],
    errors: list[str],
    util: list[dict[str, float]],
    per_request_us: list[dict[str, float]],
) -> Row:
    rate = Summary.of(rates)

    def median_of(samples: list[dict[str, float]]) -> dict[str, float]:
        return {name: statistics.median(d.get(name, 0.0) for d in samples) for name in samples[0]}

    util_median, us_median = median_of(util), median_of(per_request_us)
    who = "1 client process" if n_clients == 1 else f"{n_clients} client processes"
    cpus = os.cpu_count() or 1
    notes = [
        f"{sizes.requests} requests/rep x {sizes.reps} reps, prompt {PROMPT!r} (4 outputs "
        "checked per request); p50/p99 = submit -> finished output",
        "CPU, % of one core over the load window (median of reps): "
        + ", ".join(f"{name} {100 * v:.0f}%" for name, v in util_median.items())
        + f" (of {100 * cpus}%)",
        "CPU per request: " + ", ".join(f"{name} {v:.0f} us" for name, v in us_median.items()),
    ]
    if util_median.get(OTHER, 0.0) > SHARED_MACHINE_FRACTION:
        notes.append(
            f"WARNING: {100 * util_median[OTHER]:.0f}% of a core went to processes outside the "
            "benchmark: the machine was shared, these figures are pessimistic"
        )
    if errors:
        notes.append(f"{len(errors)} failed or wrong requests, e.g. {errors[0]}")
    lat = latencies_ns or [0]
    return Row(
        bench="1:e2e throughput",
        config=f"{who}, concurrency {concurrency}",
        metric="requests/s",
        unit="1/s",
        value=rate,
        p50_ms=percentile(lat, 50) / 1e6,
        p99_ms=percentile(lat, 99) / 1e6,
        target=f">= {TARGET_RPS:,.0f}/s",
        met=rate.median >= TARGET_RPS and not errors,
        notes=notes,
        details={"cpu_fraction_of_core": util_median, "cpu_us_per_request": us_median},
    )


# --- (2) per-hop latency: instrumented orchestrator in this process ---------------------------


class HopStamps:
    """Stamps of the in-process orchestrator, keyed (stage id, request id)."""

    def __init__(self) -> None:
        self.arrived: dict[tuple[int, str], int] = {}
        """A reply holding the stage's finished output was in hand (before validation)."""
        self.returned: dict[tuple[int, str], int] = {}
        """`get_output` returned it."""
        self.submitted: dict[tuple[int, str], int] = {}
        """The dispatcher called `submit` of this stage (forward_fn done)."""
        self.write_start: dict[tuple[int, str], int] = {}
        """The writer task began the pipeline carrying this stage input."""
        self.write_done: dict[tuple[int, str], int] = {}
        """That pipeline's replies were in hand."""
        self.request_replies: list[tuple[int, Any]] = []
        """(stamp, reply) of every read of the requests stream that returned entries."""

    def requests_read(self) -> dict[str, int]:
        """request id -> when the orchestrator's read of the requests stream returned it."""
        from omni_runtime import codec

        out: dict[str, int] = {}
        for t, reply in self.request_replies:
            for _stream, entries in reply:
                for _eid, fields in entries:
                    with contextlib.suppress(Exception):
                        msg = codec.decode(fields[keys.PAYLOAD_FIELD.encode()])
                        out.setdefault(msg["request_id"], t)
        return out


def make_stamping_read_group(stamps: HopStamps) -> Any:
    """`read_group` of the service module (it reads only the requests stream), stamped."""
    from omni_runtime.redis_io.stage_client import read_group

    async def stamped_read_group(*args: Any, **kwargs: Any) -> Any:
        reply = await read_group(*args, **kwargs)
        if reply:
            stamps.request_replies.append((time.monotonic_ns(), reply))
        return reply

    return stamped_read_group


def make_instrumented_classes(stamps: HopStamps) -> tuple[type, type]:
    """Subclasses of StreamWriter and RedisStageClient that record `stamps`; logic untouched."""
    from omni_runtime.core.types import StageOutput
    from omni_runtime.redis_io.stage_client import Entry, RedisStageClient, StreamWriter

    class StampingWriter(StreamWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.next_tag: tuple[int, str] | None = None
            self._tag_of: dict[int, tuple[int, str]] = {}

        def xadd(
            self,
            stream: str,
            fields: dict[str, Any],
            maxlen: int | None = None,
            urgent: bool = False,
        ) -> None:
            if self.next_tag is not None:  # a stage input, queued by StampingStageClient
                self._tag_of[id(fields)] = self.next_tag
                self.next_tag = None
            super().xadd(stream, fields, maxlen, urgent)

        async def _write(self, ops: list[tuple[str, tuple[Any, ...]]]) -> bool:
            t0 = time.monotonic_ns()
            tags = [
                tag
                for op, args in ops
                if op == "xadd" and (tag := self._tag_of.pop(id(args[1]), None)) is not None
            ]
            ok = await super()._write(ops)
            t1 = time.monotonic_ns()
            for tag in tags:
                stamps.write_start[tag] = t0
                stamps.write_done[tag] = t1
            return ok

    class StampingStageClient(RedisStageClient):
        def _parse(self, entries: list[Entry]) -> list[StageOutput]:
            t = time.monotonic_ns()
            outputs = super()._parse(entries)
            for out in outputs:
                if out.finished:
                    stamps.arrived.setdefault((self.stage_id, out.request_id), t)
            return outputs

        async def get_output(self) -> list[StageOutput]:
            outputs = await super().get_output()
            t = time.monotonic_ns()
            for out in outputs:
                if out.finished:
                    stamps.returned.setdefault((self.stage_id, out.request_id), t)
            return outputs

        async def submit(self, request_id: str, data: Any) -> None:
            stamps.submitted[(self.stage_id, request_id)] = time.monotonic_ns()
            if isinstance(self.writer, StampingWriter):
                self.writer.next_tag = (self.stage_id, request_id)
            await super().submit(request_id, data)

    return StampingWriter, StampingStageClient


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


class OrchestratorThread:
    """`OrchestratorService.run` on its own asyncio loop in a thread of this process."""

    def __init__(self, pipeline: PipelineConfig, settings: Settings) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="orchestrator", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def start(self, timeout_s: float) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"in-process orchestrator did not start: {self._error!r}")

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        from omni_runtime.orchestrator_proc import OrchestratorService

        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        service = OrchestratorService(self.pipeline, self.settings)
        task = asyncio.create_task(service.run(self._stop))
        ready = asyncio.create_task(service.ready.wait())
        await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            ready.cancel()
            task.result()  # raises what made it stop
        self._ready.set()
        await task

    def call(self, coro: Any, timeout_s: float) -> Any:
        """Run a coroutine on the orchestrator's loop and wait for its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def check_alive(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"in-process orchestrator stopped: {self._error!r}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)


@dataclass
class HopSamples:
    hop_ns: dict[int, list[int]] = field(default_factory=lambda: {0: [], 1: []})
    rep_p50_ns: list[float] = field(default_factory=list)
    rep_p50_by_stage_ns: dict[int, list[float]] = field(default_factory=lambda: {0: [], 1: []})
    segments_ns: dict[int, dict[str, list[int]]] = field(default_factory=lambda: {0: {}, 1: {}})
    """Per hop (0: S0->S1, 1: S1->S2): segment name -> samples."""
    timeline_ns: dict[str, list[int]] = field(default_factory=dict)
    missing: int = 0
    request_ns: list[int] = field(default_factory=list)
    request_rep_p50_ns: list[float] = field(default_factory=list)
    machine_busy: list[float] = field(default_factory=list)
    """Busy CPUs (in cores) during each light-load repetition."""
    other_busy: list[float] = field(default_factory=list)
    """Of which outside the benchmark's processes."""
    cpu_util: list[dict[str, float]] = field(default_factory=list)
    """Per process, cores busy during each light-load repetition."""
    errors: list[str] = field(default_factory=list)


SEGMENTS = (
    ("validate", "arrived", "returned"),
    ("queue+dispatch+forward", "returned", "submitted"),
    ("writer task wake", "submitted", "write_start"),
    ("pipeline XADD round trip", "write_start", "write_done"),
    ("XADD -> worker read", "write_start", "read"),
)


def _add_spans(
    at: dict[str, int | None], spans: tuple[tuple[str, str, str], ...], into: dict[str, list[int]]
) -> None:
    """Append `to - from` under each span's name where both of its stamps exist."""
    for name, a, b in spans:
        ta, tb = at[a], at[b]
        if ta is not None and tb is not None:
            into.setdefault(name, []).append(tb - ta)


def collect_hops(
    stamps: HopStamps, worker_reads: dict[int, dict[str, int]], rids: list[str], out: HopSamples
) -> None:
    """One repetition: hop s -> s+1 = worker s+1 read - arrival of stage s's finished output."""
    rep: list[int] = []
    for sid in (0, 1):
        by_stage: list[int] = []
        for rid in rids:
            key = (sid, rid)
            nxt = (sid + 1, rid)
            at = {
                "arrived": stamps.arrived.get(key),
                "returned": stamps.returned.get(key),
                "submitted": stamps.submitted.get(nxt),
                "write_start": stamps.write_start.get(nxt),
                "write_done": stamps.write_done.get(nxt),
                "read": worker_reads[sid + 1].get(rid),
            }
            arrived, read = at["arrived"], at["read"]
            if arrived is None or read is None:
                out.missing += 1
                continue
            by_stage.append(read - arrived)
            _add_spans(at, SEGMENTS, out.segments_ns[sid])
        out.hop_ns[sid].extend(by_stage)
        if by_stage:
            out.rep_p50_by_stage_ns[sid].append(percentile(by_stage, 50))
        rep.extend(by_stage)
    if rep:
        out.rep_p50_ns.append(percentile(rep, 50))


TIMELINE = (
    ("client submit -> orchestrator read", "submit", "request read"),
    ("-> S0 read", "request read", "read 0"),
    ("S0 run -> orchestrator read", "read 0", "out 0"),
    ("hop S0->S1", "out 0", "read 1"),
    ("S1 run -> orchestrator read", "read 1", "out 1"),
    ("hop S1->S2", "out 1", "read 2"),
    ("S2 run -> orchestrator read", "read 2", "out 2"),
    ("-> client has it", "out 2", "done"),
)
"""A light-load request, end to end: (segment, from stamp, to stamp)."""


def collect_timeline(
    stamps: HopStamps,
    worker_reads: dict[int, dict[str, int]],
    client_stamps: dict[str, list[int]],
    out: HopSamples,
) -> None:
    requests_read = stamps.requests_read()
    for rid, (submit, done) in client_stamps.items():
        at: dict[str, int | None] = {"submit": submit, "done": done}
        at["request read"] = requests_read.get(rid)
        for sid in (0, 1, 2):
            at[f"read {sid}"] = worker_reads[sid].get(rid)
            at[f"out {sid}"] = stamps.arrived.get((sid, rid))
        _add_spans(at, TIMELINE, out.timeline_ns)


def bench_hop(sizes: Sizes, url: str, log_dir: Path) -> list[Row]:
    from omni_runtime import orchestrator_proc as service_module

    pipeline = load_pipeline(SEED_PIPELINE)
    namespace = _namespace("hop")
    settings = Settings(redis_url=url, namespace=namespace)
    env = child_env(url, {"OMNI_NAMESPACE": namespace})
    stage_ids = list(range(pipeline.last_stage + 1))
    stamp_files = {sid: log_dir / f"reads-stage{sid}.txt" for sid in stage_ids}
    raw_stream = f"{namespace}:raw"
    stamps = HopStamps()
    writer_cls, stage_cls = make_instrumented_classes(stamps)
    workers: list[LineProc] = []
    clients: list[LineProc] = []
    consumer: LineProc | None = None
    producer: LineProc | None = None
    orch: OrchestratorThread | None = None
    hops = HopSamples()
    raw_sync: list[int] = []
    raw_async: list[int] = []
    raw_sync_rep_p50: list[float] = []
    raw_async_rep_p50: list[float] = []
    patches = contextlib.ExitStack()
    try:
        patches.enter_context(patched(service_module, "StreamWriter", writer_cls))
        patches.enter_context(patched(service_module, "RedisStageClient", stage_cls))
        patches.enter_context(
            patched(service_module, "read_group", make_stamping_read_group(stamps))
        )
        orch = OrchestratorThread(pipeline, settings)
        orch.start(STARTUP_TIMEOUT_S)
        for sid in stage_ids:
            cmd = _role_cmd(
                "stamped-worker",
                *("--pipeline", str(SEED_PIPELINE), "--stage", str(sid)),
                *("--stamp-file", str(stamp_files[sid])),
            )
            workers.append(LineProc(f"stamped-worker{sid}", cmd, env, log_dir))
        clients = start_clients(1, url, namespace, stage_ids, log_dir)
        consumer = LineProc(
            "raw-consumer",
            _role_cmd("raw-consumer", "--redis-url", url, "--stream", raw_stream),
            child_env(url),
            log_dir,
        )
        consumer.recv(STARTUP_TIMEOUT_S)
        producer = LineProc(
            "raw-producer",
            _role_cmd("raw-producer", "--redis-url", url, "--stream", raw_stream),
            child_env(url),
            log_dir,
        )
        producer.recv(STARTUP_TIMEOUT_S)
        raw_timeout_s = 30 + sizes.raw_messages * 0.01

        def raw_sync_run(n: int) -> list[int]:
            assert producer is not None and consumer is not None
            producer.send({"op": "produce", "n": n})
            producer.recv(raw_timeout_s)
            samples: list[int] = consumer.recv(raw_timeout_s)["samples_ns"]
            return samples

        pids = {"benchmark+orchestrator": os.getpid()}
        pids |= {p.name: p.proc.pid for p in [*workers, *clients, consumer, producer]}
        server_pid = redis_server_pid(url, names=("redis", "valkey"))
        if server_pid is not None:
            pids["redis-server"] = server_pid
        sampler = CpuSampler(pids)

        def check_alive() -> None:
            for w in workers:
                if w.proc.poll() is not None:
                    raise RuntimeError(f"{w.name} exited\n{w.tail()}")
            assert orch is not None
            orch.check_alive()

        # warm-up: every code path once
        run_load(clients, 20, 1, sizes.light_gap_ms, "hopwarm", check_alive=check_alive)
        raw_sync_run(20)
        for rep in range(sizes.reps):
            gc.collect()
            samples = raw_sync_run(sizes.raw_messages)
            raw_sync.extend(samples)
            raw_sync_rep_p50.append(percentile(samples, 50))

            gc.collect()
            tag = f"hop{rep}"
            sampler.start()
            (result,) = run_load(
                clients,
                sizes.light_requests,
                1,
                sizes.light_gap_ms,
                tag,
                timeline=True,
                check_alive=check_alive,
            )
            cpu_s = sampler.stop()
            wall_s = (result["t_end_ns"] - result["t_start_ns"]) / 1e9
            hops.machine_busy.append(cpu_s[MACHINE] / wall_s)
            hops.other_busy.append(cpu_s[OTHER] / wall_s)
            hops.cpu_util.append({name: v / wall_s for name, v in cpu_s.items()})
            check_alive()
            time.sleep(0.05)  # the last stage's read stamp is written right after its read
            rids = [f"{tag}c0-{i}" for i in range(sizes.light_requests)]
            reads = {sid: read_worker_stamps(stamp_files[sid], tag) for sid in stage_ids}
            collect_hops(stamps, reads, rids, hops)
            collect_timeline(stamps, reads, result["timeline"], hops)
            hops.request_ns.extend(result["latencies_ns"])
            if result["latencies_ns"]:
                hops.request_rep_p50_ns.append(percentile(result["latencies_ns"], 50))
            hops.errors.extend(result["errors"])

            gc.collect()
            orch.call(raw_produce_async(url, raw_stream, sizes.raw_messages), 60)
            samples = consumer.recv(raw_timeout_s)["samples_ns"]
            raw_async.extend(samples)
            raw_async_rep_p50.append(percentile(samples, 50))
    finally:
        for c in clients:
            c.stop()
        if producer is not None:
            producer.stop(5)
        if consumer is not None:
            with contextlib.suppress(redis.RedisError):
                r = redis.Redis.from_url(url)
                r.xadd(raw_stream, {"m": msgpack.packb({"op": "exit"})})
                r.close()
            consumer.stop(5)
        for w in workers:
            if w.proc.poll() is None:
                w.proc.terminate()  # SIGTERM: the worker drains and exits
        for w in workers:
            w.stop()
        if orch is not None:
            orch.stop()
        patches.close()
        delete_keys(url, f"{namespace}:*")
    return _hop_rows(sizes, hops, raw_sync, raw_sync_rep_p50, raw_async, raw_async_rep_p50)


def _us(ns: float) -> float:
    return ns / 1e3


def _hop_rows(
    sizes: Sizes,
    hops: HopSamples,
    raw_sync: list[int],
    raw_sync_rep_p50: list[float],
    raw_async: list[int],
    raw_async_rep_p50: list[float],
) -> list[Row]:
    raw_p50 = percentile(raw_sync, 50)
    raw_p99 = percentile(raw_sync, 99)
    light = (
        f"1 request in flight, next ~{sizes.light_gap_ms:g} ms after the previous finished, "
        f"{sizes.light_requests} requests/rep x {sizes.reps} reps"
    )
    pooled_segments: dict[str, list[int]] = {}
    for by_name in hops.segments_ns.values():
        for seg, values in by_name.items():
            pooled_segments.setdefault(seg, []).extend(values)
    rows: list[Row] = []
    configs: list[tuple[str, list[int], list[float], dict[str, list[int]]]] = [
        (
            "S0->S1 and S1->S2 pooled",
            hops.hop_ns[0] + hops.hop_ns[1],
            hops.rep_p50_ns,
            pooled_segments,
        ),
        ("S0->S1", hops.hop_ns[0], hops.rep_p50_by_stage_ns[0], hops.segments_ns[0]),
        ("S1->S2", hops.hop_ns[1], hops.rep_p50_by_stage_ns[1], hops.segments_ns[1]),
    ]
    for name, samples, rep_p50, segments in configs:
        if not samples:
            continue
        p50 = percentile(samples, 50)
        ratio = p50 / raw_p50
        seg_p50 = {k: _us(percentile(v, 50)) for k, v in segments.items() if v}
        notes = [
            f"{light}; {len(samples)} hops; "
            f"p99 ratio vs raw p99: {percentile(samples, 99) / raw_p99:.2f}x",
            "segments, p50 us: " + ", ".join(f"{k} {v:.0f}" for k, v in seg_p50.items()),
        ]
        if name.endswith("pooled"):
            notes.append(
                "hop = worker's XREADGROUP returned the input - orchestrator's XREADGROUP "
                "returned the previous stage's finished output"
            )
            if hops.missing:
                notes.append(f"{hops.missing} hops without both stamps (not counted)")
            if hops.machine_busy:
                other = statistics.median(hops.other_busy)
                notes.append(
                    f"machine busy during the light-load reps: "
                    f"{100 * statistics.median(hops.machine_busy):.0f}% of a core, of which "
                    f"{100 * other:.0f}% outside the benchmark's processes"
                    + (
                        " -- WARNING: the machine was shared"
                        if other > SHARED_MACHINE_FRACTION
                        else ""
                    )
                )
                util = {
                    k: statistics.median(d.get(k, 0.0) for d in hops.cpu_util)
                    for k in hops.cpu_util[0]
                    if k not in (MACHINE, OTHER)
                }
                notes.append(
                    "CPU during the light-load reps, % of one core: "
                    + ", ".join(f"{k} {100 * v:.0f}%" for k, v in util.items())
                )
        rows.append(
            Row(
                bench="2:hop",
                config=name,
                metric="us hop p50",
                unit="us",
                value=Summary.of([_us(v) for v in rep_p50]),
                p50_ms=p50 / 1e6,
                p99_ms=percentile(samples, 99) / 1e6,
                baseline="raw XADD->XREADGROUP p50",
                baseline_value=_us(raw_p50),
                ratio=ratio,
                target=f"p50 ratio <= {TARGET_HOP_RATIO:g}x",
                met=ratio <= TARGET_HOP_RATIO,
                notes=notes,
                details={
                    "segments_p50_us": seg_p50,
                    "segments_p99_us": {
                        k: _us(percentile(v, 99)) for k, v in segments.items() if v
                    },
                },
            )
        )
    for label, samples, rep_p50, note in (
        (
            "sync redis-py producer",
            raw_sync,
            raw_sync_rep_p50,
            "producer and consumer each a process of its own; the baseline of the ratios",
        ),
        (
            "redis.asyncio producer",
            raw_async,
            raw_async_rep_p50,
            "producer on the orchestrator's event loop (same process, same client library)",
        ),
    ):
        rows.append(
            Row(
                bench="2:raw hand-off",
                config=label,
                metric="us p50",
                unit="us",
                value=Summary.of([_us(v) for v in rep_p50]),
                p50_ms=percentile(samples, 50) / 1e6,
                p99_ms=percentile(samples, 99) / 1e6,
                notes=[
                    f"XADD -> XREADGROUP BLOCK, 2 processes, ~200 B, U(2,4) ms apart, "
                    f"{sizes.raw_messages} msgs/rep x {sizes.reps} reps; {note}"
                ],
            )
        )
    if hops.request_ns:
        rows.append(
            Row(
                bench="2:light load",
                config="request latency",
                metric="us p50",
                unit="us",
                value=Summary.of([_us(v) for v in hops.request_rep_p50_ns]),
                p50_ms=percentile(hops.request_ns, 50) / 1e6,
                p99_ms=percentile(hops.request_ns, 99) / 1e6,
                notes=[
                    f"submit -> finished output, {light}",
                    "timeline, p50 us: "
                    + ", ".join(
                        f"{name} {_us(percentile(v, 50)):.0f}"
                        for name, v in hops.timeline_ns.items()
                        if v
                    ),
                ]
                + ([f"{len(hops.errors)} failed: {hops.errors[0]}"] if hops.errors else []),
                details={
                    "timeline_p50_us": {
                        k: _us(percentile(v, 50)) for k, v in hops.timeline_ns.items() if v
                    },
                    "timeline_p99_us": {
                        k: _us(percentile(v, 99)) for k, v in hops.timeline_ns.items() if v
                    },
                },
            )
        )
    return rows


# --- output -----------------------------------------------------------------------------------


def _fmt(x: float, unit: str) -> str:
    if unit == "us":
        return f"{x:,.0f}"
    return f"{x / 1e3:,.2f}k" if x >= 1e3 else f"{x:,.1f}"


def _fmt_baseline(x: float, unit: str) -> str:
    return f"{_fmt(x, unit)} {'us' if unit == 'us' else '/s'}"


def _git_state() -> dict[str, Any]:
    """`git_head`: the commit, " (dirty)" if the tree has changes (untracked files count)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain")
        return {"git_head": head + (" (dirty)" if dirty else "")}
    return {}


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = base_parser(
        __doc__,
        DEFAULT_JSON,
        redis_help="Redis to use (default: start a private redis-server)",
        quick_help="smaller sizes for a smoke run",
    )
    hidden = argparse.SUPPRESS  # the child processes this benchmark starts
    parser.add_argument(
        "--role",
        choices=["bench", "client", "stamped-worker", "raw-consumer", "raw-producer"],
        default="bench",
        help=hidden,
    )
    parser.add_argument("--namespace", help=hidden)
    parser.add_argument("--stages", default="0,1,2", help=hidden)
    parser.add_argument("--pipeline", help=hidden)
    parser.add_argument("--stage", type=int, help=hidden)
    parser.add_argument("--stamp-file", help=hidden)
    parser.add_argument("--stream", help=hidden)
    return parser.parse_args(argv)


def run(args: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    sizes = QUICK if args.quick else FULL
    started = time.perf_counter()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    try:
        rows = bench_throughput(sizes, redis_url, log_dir)
        rows += bench_hop(sizes, redis_url, log_dir)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    elapsed = time.perf_counter() - started
    print(format_table(rows, _fmt, _fmt_baseline))
    print(f"\ntotal {elapsed:.1f} s ({'quick' if args.quick else 'full'})")
    return {
        "mode": "quick" if args.quick else "full",
        "sizes": asdict(sizes),
        "environment": environment(redis_url) | _git_state(),
        "elapsed_s": elapsed,
        "rows": [asdict(r) for r in rows],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "client":
        return client_role(args)
    if args.role == "stamped-worker":
        return stamped_worker_role(args)
    if args.role == "raw-consumer":
        return raw_consumer_role(args)
    if args.role == "raw-producer":
        return raw_producer_role(args)
    with redis_or_private(
        args.redis_url, "redis-server not on PATH: install it or pass --redis-url"
    ) as url:
        result = run(args, url)
    write_results(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
