"""Time to first audio packet: the omni pipeline in sequential vs streaming mode (SPEC §1).

The pipeline is ``workers/omni.yaml`` (thinker -> talker -> code2wav, finals {0, 2}): the user
sees text tokens from stage 0 and audio chunks from stage 2. A temporary copy of the file
carries ``--token-delay-ms``; the same copy is loaded twice with ``load_pipeline(path, mode=...)``
and both deployments run at once as real processes (``ProcessGroup``: one orchestrator and one
worker per stage each) over a loopback redis-server, each in its own ``OMNI_NAMESPACE``. The
load comes from one ``OmniClient`` in this process.

(1) Latency per mode x concurrency. The prompt has exactly ``--tokens`` tokens (distinct
    words; the thinker splits on ``\\w+|[^\\w\\s]``). Concurrency C is closed-loop: C client
    tasks, each submitting its next request when the previous one finished; per cell
    ``max(min_requests, C * rounds)`` requests, after a warm-up that is not counted. Per
    request, all on ``time.perf_counter`` in this process, from just before ``submit``:

    * TTFT: first stage-0 output (a text token) out of ``OmniClient.stream``;
    * TTFP: first stage-2 output with audio samples;
    * E2E: the output with ``finished=True``.

    Every request is checked: the stage-0 outputs are exactly the prompt's tokens, in order,
    and the stage-2 audio has ``sum(len(token)) * frame_len`` samples. p50/p99 are
    nearest-rank over the requests of the cell (with 20 requests p99 is the maximum).
    Cells of the two modes are interleaved per concurrency (sequential, then streaming).

(2) Idle CPU. With both pipelines up, warmed up and no request in flight for the window,
    utime + stime from ``/proc/<pid>/stat`` of every orchestrator and worker process (pids
    from ``ProcessGroup.procs``) and of the redis-server, as % of one core. ``stat`` counts
    10 ms ticks (0.33 % of a core over 3 s), so the on-CPU ns of every thread
    (``/proc/<pid>/task/*/schedstat``) are read alongside, and the target is judged on those.

(3) Chunk hand-off between stages over Redis, no pipeline running. Two processes
    (multiprocessing spawn). ``adapter``: the sender process runs ``ChunkAdapter(connector,
    stage_id=0)`` and calls ``save_async`` every U(2, 4) ms with a CLOCK_MONOTONIC stamp in a
    talker-sized payload; the receiver process runs ``ChunkAdapter(connector, stage_id=1,
    on_ready=event.set)`` (both ``RedisConnector``, as in a worker) and a scheduler thread
    that sleeps on that Event, calls ``poll_ready`` and records now - stamp. Baselines in
    the same run, same payload (``omni_runtime.codec``), same pacing: ``raw RPUSH->BLPOP``
    (payload in the list, one-way) and ``raw SET+RPUSH->BLPOP->GET`` (the adapter's own
    Redis round trips - value under a key, a wake-up on a list, then a read - with no
    threads in between). The first ``handoff_warmup`` chunks are not counted.

Targets: streaming TTFP <= 1/10 of sequential at C=1 and >= 5x better at C=32; streaming TTFT
<= 1.1x sequential and streaming E2E <= sequential at every C (all on p50); adapter
hand-off p50 <= 0.5 ms and p99 <= 1.5 ms; every idle pipeline process <= 1 % of a core.

Run ``python benchmarks/bench_ttfp.py [--quick] [--redis-url URL] [--json PATH]
[--token-delay-ms 20] [--tokens 50]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import queue
import random
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis
import yaml
from common import (
    ROOT,
    base_parser,
    delete_keys,
    environment,
    git,
    met_cell,
    percentile,
    proc_cpu_s,
    redis_or_private,
    redis_server_pid,
    write_results,
)

from omni_runtime import codec, keys
from omni_runtime.chunks.adapter import ChunkAdapter
from omni_runtime.chunks.redis import RedisConnector
from omni_runtime.client import OmniClient, RequestTimeoutError
from omni_runtime.launcher import ProcessGroup, child_env
from omni_runtime.pipeline import PipelineConfig, load_pipeline
from omni_runtime.settings import Settings

OMNI_YAML = ROOT / "workers" / "omni.yaml"
DEFAULT_JSON = Path("benchmarks/results/bench_ttfp.json")
MODES = ("sequential", "streaming")
TEXT_STAGE = 0
AUDIO_STAGE = 2

TARGET_TTFP_C1 = 10.0
"""Streaming TTFP <= sequential / this, at concurrency 1."""
TARGET_TTFP_C32 = 5.0
"""Sequential / streaming TTFP >= this, at concurrency 32."""
TARGET_TTFT_RATIO = 1.1
TARGET_E2E_RATIO = 1.0
TARGET_HANDOFF_P50_MS = 0.5
TARGET_HANDOFF_P99_MS = 1.5
TARGET_IDLE_PCT = 1.0

STARTUP_TIMEOUT_S = 60.0
OUTPUT_TIMEOUT_S = 30.0
"""Longest wait for a request's next output."""
HANDOFF_GAP_MS = (2.0, 4.0)
HANDOFF_CODES = [17, 404, 1000, 3, 512, 77, 901]
"""A talker-sized chunk: a token's worth of codec codes."""

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dogs", "while", "seven", "wizards",
    "quietly", "hum", "bright", "songs", "about", "distant", "rivers", "mountains", "forests",
    "oceans", "cities", "bridges", "lanterns", "gardens", "meadows", "thunder", "whispers",
    "shadows", "crystal", "engines", "harbors", "valleys", "silver", "copper", "golden",
    "marble", "velvet", "amber", "cedar", "willow", "falcon", "heron", "otter", "badger", "lynx",
    "raven", "sparrow", "maple", "birch", "orchard", "canyon", "glacier", "prairie", "tundra",
    "lagoon", "delta", "summit",
)  # fmt: skip
"""Prompt vocabulary: words of 3-9 letters, so audio chunk sizes vary like real tokens."""

T = TypeVar("T")


# --- sizes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    concurrencies: tuple[int, ...]
    rounds: int
    """Requests per client task (closed loop)."""
    min_requests: int
    warmup_requests: int
    idle_window_s: float
    idle_settle_s: float
    handoff_chunks: int
    handoff_warmup: int

    def requests(self, concurrency: int) -> int:
        return max(self.min_requests, concurrency * self.rounds)


FULL = Sizes(
    concurrencies=(1, 8, 32),
    rounds=3,
    min_requests=20,
    warmup_requests=4,
    idle_window_s=3.0,
    idle_settle_s=1.0,
    handoff_chunks=1000,
    handoff_warmup=50,
)
QUICK = Sizes(
    concurrencies=(1, 8),
    rounds=2,
    min_requests=5,
    warmup_requests=2,
    idle_window_s=3.0,
    idle_settle_s=0.5,
    handoff_chunks=300,
    handoff_warmup=30,
)


# --- statistics -------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


# --- the prompt -----------------------------------------------------------------------------


def make_prompt(n_tokens: int) -> tuple[str, list[str]]:
    """A prompt of exactly `n_tokens` thinker tokens (words), and those tokens."""
    tokens = [
        WORDS[i % len(WORDS)] + (str(i // len(WORDS)) if i >= len(WORDS) else "")
        for i in range(n_tokens)
    ]
    return " ".join(tokens), tokens


def write_pipeline_copy(dest_dir: Path, token_delay_ms: float) -> tuple[Path, int]:
    """workers/omni.yaml with the thinker's token delay set; (path, samples per codec code)."""
    raw = yaml.safe_load(OMNI_YAML.read_text())
    for stage in raw["stages"]:
        if stage["name"] == "thinker":
            stage.setdefault("options", {})["token_delay_ms"] = token_delay_ms
    code2wav = next(s for s in raw["stages"] if s["id"] == AUDIO_STAGE)["options"]
    frame_len = round(
        int(code2wav.get("sample_rate", 16000)) * float(code2wav.get("frame_ms", 20)) / 1000
    )
    path = dest_dir / "omni-bench.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path, frame_len


# --- deployments ----------------------------------------------------------------------------


class Deployment:
    """One mode of the pipeline: its processes, in their own namespace."""

    def __init__(self, redis_url: str, pipeline_path: Path, mode: str) -> None:
        self.mode = mode
        self.namespace = f"bench-ttfp-{mode[:3]}-{uuid.uuid4().hex[:8]}"
        self.pipeline: PipelineConfig = load_pipeline(pipeline_path, mode=mode)
        self.settings = Settings(redis_url=redis_url, namespace=self.namespace)
        env = child_env(redis_url, {"OMNI_NAMESPACE": self.namespace})
        self.group = ProcessGroup(pipeline_path, self.pipeline, env)

    @property
    def stage_ids(self) -> list[int]:
        return list(range(self.pipeline.last_stage + 1))

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc, _log in self.group.procs}


async def watched(deployments: Sequence[Deployment], work: Awaitable[T], timeout_s: float) -> T:
    """Await `work` within `timeout_s`, failing fast (with its log) if a process dies."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    deadline = loop.time() + timeout_s
    try:
        while not task.done():
            for d in deployments:
                d.group.check_alive()
            if loop.time() > deadline:
                raise TimeoutError(f"benchmark step did not finish within {timeout_s:g} s")
            await asyncio.wait({task}, timeout=0.2)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


# --- (1) latency cells ----------------------------------------------------------------------


@dataclass
class RequestResult:
    ttft_ms: float | None
    ttfp_ms: float | None
    e2e_ms: float | None
    error: str | None = None


@dataclass
class Expected:
    prompt: str
    tokens: list[str]
    audio_samples: int


async def one_request(client: OmniClient, expected: Expected) -> RequestResult:
    t0 = time.perf_counter()
    ttft = ttfp = None
    texts: list[Any] = []
    samples = 0
    try:
        rid = await client.submit(expected.prompt)
        async for out in client.stream(rid, timeout_s=OUTPUT_TIMEOUT_S):
            now = time.perf_counter()
            if out.error is not None:
                return RequestResult(None, None, None, f"stage {out.stage_id}: {out.error}")
            if out.stage_id == TEXT_STAGE:
                texts.append(out.data)
                ttft = ttft or now
            elif out.stage_id == AUDIO_STAGE:
                n = len(out.data)
                samples += n
                if ttfp is None and n > 0:
                    ttfp = now
    except RequestTimeoutError as e:
        return RequestResult(None, None, None, str(e))
    end = time.perf_counter()
    if texts != expected.tokens:
        return RequestResult(None, None, None, f"text mismatch: {texts[:3]!r}... ({len(texts)})")
    if samples != expected.audio_samples:
        return RequestResult(
            None, None, None, f"audio: {samples} samples, expected {expected.audio_samples}"
        )
    if ttft is None or ttfp is None:
        return RequestResult(None, None, None, "no text or no audio output")
    return RequestResult((ttft - t0) * 1e3, (ttfp - t0) * 1e3, (end - t0) * 1e3)


async def run_closed_loop(
    d: Deployment, expected: Expected, concurrency: int, n_requests: int
) -> tuple[list[RequestResult], float]:
    """`concurrency` tasks, each submitting its next request when its last one finished."""
    results: list[RequestResult] = []
    remaining = [n_requests]

    async with OmniClient(d.settings) as client:

        async def user() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                results.append(await one_request(client, expected))

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


@dataclass
class Cell:
    mode: str
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttfp_p50_ms: float | None = None
    ttfp_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p99_ms: float | None = None
    ttft_mean_ms: float | None = None
    ttfp_mean_ms: float | None = None
    e2e_mean_ms: float | None = None
    error_samples: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, mode: str, conc: int, results: list[RequestResult], wall: float) -> Cell:
        ok = [r for r in results if r.error is None]
        cell = cls(mode, conc, len(results), len(results) - len(ok), wall)
        cell.error_samples = sorted({r.error for r in results if r.error is not None})[:5]
        if ok:
            for name in ("ttft", "ttfp", "e2e"):
                vals = [float(getattr(r, f"{name}_ms")) for r in ok]
                setattr(cell, f"{name}_p50_ms", percentile(vals, 50))
                setattr(cell, f"{name}_p99_ms", percentile(vals, 99))
                setattr(cell, f"{name}_mean_ms", statistics.fmean(vals))
        return cell


# --- (2) idle CPU -----------------------------------------------------------------------------


def proc_cpu_ns(pid: int) -> int | None:
    """On-CPU ns of all the process's threads (`/proc/<pid>/task/*/schedstat`), or None.

    Nanosecond resolution, where `/proc/<pid>/stat` counts 10 ms ticks (0.33 % of a core
    over a 3 s window): the idle target is judged on this one when the kernel has it.
    """
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just exited
    return total if tasks else None


@dataclass
class IdleRow:
    mode: str
    process: str
    pid: int
    window_s: float
    stat_cpu_s: float
    """utime + stime delta from /proc/<pid>/stat (10 ms ticks)."""
    stat_pct_of_core: float
    schedstat_pct_of_core: float | None
    """Same from the summed per-thread schedstat (ns); None if unavailable."""
    target: str
    met: bool | None

    @property
    def pct_of_core(self) -> float:
        """The finer of the two measurements."""
        if self.schedstat_pct_of_core is not None:
            return self.schedstat_pct_of_core
        return self.stat_pct_of_core


async def measure_idle(
    deployments: Sequence[Deployment], redis_pid: int | None, window_s: float
) -> list[IdleRow]:
    pids: list[tuple[str, str, int]] = [
        (d.mode, name, pid) for d in deployments for name, pid in d.pids().items()
    ]
    if redis_pid is not None:
        pids.append(("(both)", "redis-server", redis_pid))
    c0 = {pid: (proc_cpu_s(pid), proc_cpu_ns(pid)) for _m, _n, pid in pids}
    t0 = time.monotonic()
    await watched(deployments, asyncio.sleep(window_s), window_s + 10)
    elapsed = time.monotonic() - t0
    c1 = {pid: (proc_cpu_s(pid), proc_cpu_ns(pid)) for _m, _n, pid in pids}
    rows: list[IdleRow] = []
    for mode, name, pid in pids:
        (a, a_ns), (b, b_ns) = c0[pid], c1[pid]
        if a is None or b is None:
            continue
        fine = None if a_ns is None or b_ns is None else (b_ns - a_ns) / 1e9 / elapsed * 100
        pipeline_proc = name != "redis-server"
        row = IdleRow(
            mode,
            name,
            pid,
            elapsed,
            b - a,
            (b - a) / elapsed * 100,
            fine,
            f"<= {TARGET_IDLE_PCT:g} %" if pipeline_proc else "(info)",
            None,
        )
        if pipeline_proc:
            row.met = row.pct_of_core <= TARGET_IDLE_PCT
        rows.append(row)
    return rows


# --- (3) chunk hand-off -----------------------------------------------------------------------

HANDOFF_KINDS = ("adapter", "raw_blpop", "raw_set_blpop_get")
HANDOFF_LABELS = {
    "adapter": "ChunkAdapter+RedisConnector, save_async -> poll_ready",
    "raw_blpop": "raw RPUSH -> BLPOP (payload in list)",
    "raw_set_blpop_get": "raw SET+RPUSH -> BLPOP -> GET (adapter's round trips)",
}


def _now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _sleep_until(t_ns: int) -> None:
    delay = (t_ns - _now_ns()) / 1e9
    if delay > 0:
        time.sleep(delay)


def handoff_sender(
    kind: str, url: str, prefix: str, rid: str, total: int, start: Any, done: Any
) -> None:
    """Spawned: send `total` stamped chunks every U(2, 4) ms once the receiver is ready."""
    rng = random.Random(rid)
    adapter: ChunkAdapter | None = None
    connector: RedisConnector | None = None
    client: redis.Redis | None = None
    if kind == "adapter":
        connector = RedisConnector.from_url(url, prefix=prefix)
        adapter = ChunkAdapter(connector, stage_id=0)
    else:
        client = redis.Redis.from_url(url)
        client.ping()
    list_key = f"{prefix}list:{rid}"
    try:
        if not start.wait(30):
            return
        next_at = _now_ns()
        for seq in range(total):
            _sleep_until(next_at)
            payload = {"t": _now_ns(), "seq": seq, "codes": HANDOFF_CODES}
            if adapter is not None:
                adapter.save_async(rid, payload, seq == total - 1)
            elif kind == "raw_blpop":
                assert client is not None
                client.rpush(list_key, codec.encode(payload))
            else:
                assert client is not None
                key = keys.chunk_key(rid, 0, seq, prefix)
                with client.pipeline(transaction=False) as pipe:
                    pipe.set(key, codec.encode(payload), ex=300)
                    pipe.rpush(list_key, key)
                    pipe.execute()
            next_at = _now_ns() + int(rng.uniform(*HANDOFF_GAP_MS) * 1e6)
        done.wait(30)
    finally:
        if adapter is not None:
            adapter.stop()
        if connector is not None:
            connector.close()
        if client is not None:
            client.close()


def handoff_receiver(
    kind: str, url: str, prefix: str, rid: str, total: int, warmup: int, start: Any, out: Any
) -> None:
    """Spawned: receive the chunks, put `{"lat_ns": [...], "missing": n}` on `out`."""
    deadline = time.monotonic() + total * max(HANDOFF_GAP_MS) / 1e3 * 3 + 20
    lat: list[int] = []
    seen = 0
    list_key = f"{prefix}list:{rid}"
    if kind == "adapter":
        connector = RedisConnector.from_url(url, prefix=prefix)
        ready = threading.Event()
        adapter = ChunkAdapter(connector, stage_id=1, on_ready=ready.set)
        route = keys.chunk_route_key(f"{rid}_0", prefix)

        def scheduler() -> None:
            nonlocal seen
            while seen < total and time.monotonic() < deadline:
                ready.wait(0.1)
                ready.clear()
                got = adapter.poll_ready().get(rid, [])
                now = _now_ns()
                for chunk in got:
                    seen += 1
                    if chunk["data"]["seq"] >= warmup:
                        lat.append(now - chunk["data"]["t"])
                if got and got[-1]["finished"]:
                    return

        try:
            adapter.load_async(rid)
            while not connector.client.exists(route):  # listening before the first put
                if time.monotonic() > deadline:
                    raise TimeoutError("receiver route was never registered")
                time.sleep(0.005)
            thread = threading.Thread(target=scheduler, name="scheduler", daemon=True)
            thread.start()
            start.set()
            thread.join(max(0.0, deadline - time.monotonic()) + 1)
        finally:
            adapter.stop()
            connector.close()
    else:
        client = redis.Redis.from_url(url)
        try:
            client.ping()
            start.set()
            while seen < total and time.monotonic() < deadline:
                popped = client.blpop([list_key], timeout=1)
                if popped is None:
                    continue
                raw: Any = popped[1] if kind == "raw_blpop" else client.get(popped[1])
                if raw is None:
                    continue
                payload = codec.decode(raw)
                now = _now_ns()
                seen += 1
                if payload["seq"] >= warmup:
                    lat.append(now - payload["t"])
        finally:
            client.close()
    out.put({"lat_ns": lat, "missing": total - seen})


@dataclass
class HandoffRow:
    kind: str
    label: str
    samples: int
    missing: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    target: str = ""
    met: bool | None = None


def run_handoff(url: str, kind: str, total: int, warmup: int) -> HandoffRow:
    ctx = mp.get_context("spawn")
    prefix = f"bench-ttfp-handoff-{uuid.uuid4().hex[:8]}:"
    rid = f"h{uuid.uuid4().hex[:8]}"
    start, done = ctx.Event(), ctx.Event()
    out: Any = ctx.Queue()
    recv = ctx.Process(
        target=handoff_receiver,
        args=(kind, url, prefix, rid, total, warmup, start, out),
        name=f"handoff-recv-{kind}",
    )
    send = ctx.Process(
        target=handoff_sender,
        args=(kind, url, prefix, rid, total, start, done),
        name=f"handoff-send-{kind}",
    )
    timeout_s = total * max(HANDOFF_GAP_MS) / 1e3 * 3 + 40
    result: dict[str, Any] = {"lat_ns": [], "missing": total}
    try:
        recv.start()
        send.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                result = out.get(timeout=0.5)
                break
            except queue.Empty:
                if recv.exitcode is not None or send.exitcode not in (None, 0):
                    break  # a side died without a result: fail fast, not at the deadline
        done.set()
        for p in (send, recv):
            p.join(10)
    finally:
        for p in (send, recv):
            if p.is_alive():
                p.terminate()
                p.join(5)
        out.close()
        delete_keys(url, f"{prefix}*")
    lat = [x / 1e6 for x in result["lat_ns"]]
    return HandoffRow(
        kind,
        HANDOFF_LABELS[kind],
        len(lat),
        int(result["missing"]),
        percentile(lat, 50) if lat else None,
        percentile(lat, 90) if lat else None,
        percentile(lat, 99) if lat else None,
        max(lat) if lat else None,
    )


def bench_handoff(url: str, sizes: Sizes) -> list[HandoffRow]:
    rows = [run_handoff(url, k, sizes.handoff_chunks, sizes.handoff_warmup) for k in HANDOFF_KINDS]
    adapter = rows[0]
    adapter.target = f"p50 <= {TARGET_HANDOFF_P50_MS:g} ms, p99 <= {TARGET_HANDOFF_P99_MS:g} ms"
    adapter.met = (
        adapter.p50_ms is not None
        and adapter.p99_ms is not None
        and adapter.missing == 0
        and adapter.p50_ms <= TARGET_HANDOFF_P50_MS
        and adapter.p99_ms <= TARGET_HANDOFF_P99_MS
    )
    return rows


# --- the pipeline part ------------------------------------------------------------------------


@dataclass
class PipelineResults:
    cells: list[Cell]
    idle: list[IdleRow]
    namespaces: dict[str, str]


async def bench_pipeline(
    url: str, sizes: Sizes, pipeline_path: Path, expected: Expected, token_delay_ms: float
) -> PipelineResults:
    deployments = [Deployment(url, pipeline_path, mode) for mode in MODES]
    by_mode = {d.mode: d for d in deployments}
    one_request_s = len(expected.tokens) * token_delay_ms / 1e3 + 1.0
    try:
        for d in deployments:
            d.group.start()
        for d in deployments:
            async with OmniClient(d.settings) as client:
                await watched(
                    deployments,
                    client.wait_ready(d.stage_ids, timeout_s=STARTUP_TIMEOUT_S),
                    STARTUP_TIMEOUT_S + 5,
                )
        for d in deployments:  # warm-up: imports, connections, routes, thread pools
            await watched(
                deployments,
                run_closed_loop(d, expected, 2, sizes.warmup_requests),
                one_request_s * sizes.warmup_requests * 4 + 30,
            )
        await asyncio.sleep(sizes.idle_settle_s)
        idle = await measure_idle(deployments, redis_server_pid(url), sizes.idle_window_s)
        cells: list[Cell] = []
        for conc in sizes.concurrencies:
            n = sizes.requests(conc)
            for mode in MODES:
                d = by_mode[mode]
                timeout_s = one_request_s * 4 * -(-n // conc) + 60
                results, wall = await watched(
                    deployments, run_closed_loop(d, expected, conc, n), timeout_s
                )
                cell = Cell.of(mode, conc, results, wall)
                cells.append(cell)
                print(
                    f"  {mode:<10} c={conc:<3} {n} requests in {wall:5.1f} s, {cell.errors} errors",
                    flush=True,
                )
        return PipelineResults(cells, idle, {d.mode: d.namespace for d in deployments})
    finally:
        for d in deployments:
            d.group.stop()
            delete_keys(url, f"{d.namespace}:*")


# --- targets and output -----------------------------------------------------------------------


@dataclass
class Target:
    name: str
    measured: str
    met: bool | None


def _cell(cells: list[Cell], mode: str, conc: int) -> Cell | None:
    return next((c for c in cells if c.mode == mode and c.concurrency == conc), None)


def evaluate(
    cells: list[Cell], idle: list[IdleRow], handoff: list[HandoffRow], concs: Sequence[int]
) -> list[Target]:
    targets: list[Target] = []
    for conc, need in ((1, TARGET_TTFP_C1), (32, TARGET_TTFP_C32)):
        seq, st = _cell(cells, "sequential", conc), _cell(cells, "streaming", conc)
        name = f"TTFP seq/stream >= {need:g}x at c={conc} (p50)"
        if seq is None or st is None:
            targets.append(Target(name, "not run (--quick)" if conc not in concs else "-", None))
            continue
        r = ratio(seq.ttfp_p50_ms, st.ttfp_p50_ms)
        ok = r is not None and r >= need and not seq.errors and not st.errors
        targets.append(Target(name, "-" if r is None else f"{r:.1f}x", ok))
    for metric, limit in (("ttft", TARGET_TTFT_RATIO), ("e2e", TARGET_E2E_RATIO)):
        for conc in concs:
            seq, st = _cell(cells, "sequential", conc), _cell(cells, "streaming", conc)
            if seq is None or st is None:
                continue
            r = ratio(getattr(st, f"{metric}_p50_ms"), getattr(seq, f"{metric}_p50_ms"))
            ok = r is not None and r <= limit and not seq.errors and not st.errors
            targets.append(
                Target(
                    f"{metric.upper()} stream/seq <= {limit:g}x at c={conc} (p50)",
                    "-" if r is None else f"{r:.2f}x",
                    ok,
                )
            )
    a = handoff[0]
    targets.append(
        Target(
            f"hand-off p50 <= {TARGET_HANDOFF_P50_MS:g} ms",
            "-" if a.p50_ms is None else f"{a.p50_ms:.3f} ms",
            a.p50_ms is not None and a.p50_ms <= TARGET_HANDOFF_P50_MS and a.missing == 0,
        )
    )
    targets.append(
        Target(
            f"hand-off p99 <= {TARGET_HANDOFF_P99_MS:g} ms",
            "-" if a.p99_ms is None else f"{a.p99_ms:.3f} ms",
            a.p99_ms is not None and a.p99_ms <= TARGET_HANDOFF_P99_MS and a.missing == 0,
        )
    )
    procs = [r for r in idle if r.met is not None]
    worst = max(procs, key=lambda r: r.pct_of_core, default=None)
    targets.append(
        Target(
            f"idle pipeline process <= {TARGET_IDLE_PCT:g} % of a core (each)",
            "-"
            if worst is None
            else f"max {worst.pct_of_core:.2f} % ({worst.mode} {worst.process})",
            bool(procs) and all(r.met for r in procs),
        )
    )
    return targets


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _x(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}x"


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


def latency_table(cells: list[Cell], concs: Sequence[int]) -> str:
    header = (
        "Max_Concurrency", "Mode", "Requests", "Errors",
        "TTFT p50", "TTFT p99", "TTFP p50", "TTFP p99", "E2E p50", "E2E p99",
        "TTFP seq/stream p50 (p99)", "TTFT stream/seq p50 (p99)", "E2E stream/seq p50 (p99)",
    )  # fmt: skip
    rows: list[list[str]] = []
    for conc in concs:
        seq = _cell(cells, "sequential", conc)
        for mode in MODES:
            c = _cell(cells, mode, conc)
            if c is None:
                continue
            ratios = ["", "", ""]
            if mode == "streaming" and seq is not None:
                ratios = [
                    f"{_x(ratio(seq.ttfp_p50_ms, c.ttfp_p50_ms), 1)} "
                    f"({_x(ratio(seq.ttfp_p99_ms, c.ttfp_p99_ms), 1)})",
                    f"{_x(ratio(c.ttft_p50_ms, seq.ttft_p50_ms))} "
                    f"({_x(ratio(c.ttft_p99_ms, seq.ttft_p99_ms))})",
                    f"{_x(ratio(c.e2e_p50_ms, seq.e2e_p50_ms))} "
                    f"({_x(ratio(c.e2e_p99_ms, seq.e2e_p99_ms))})",
                ]
            rows.append(
                [
                    str(conc), mode, str(c.requests), str(c.errors),
                    _ms(c.ttft_p50_ms), _ms(c.ttft_p99_ms),
                    _ms(c.ttfp_p50_ms), _ms(c.ttfp_p99_ms),
                    _ms(c.e2e_p50_ms), _ms(c.e2e_p99_ms),
                    *ratios,
                ]
            )  # fmt: skip
    return markdown(header, rows)


def idle_table(idle: list[IdleRow]) -> str:
    header = ("Mode", "Process", "PID", "Window s", "stat CPU s", "% of a core (stat)",
              "% of a core (schedstat)", "Target", "Met")  # fmt: skip
    rows = [
        [
            r.mode, r.process, str(r.pid), f"{r.window_s:.2f}", f"{r.stat_cpu_s:.2f}",
            f"{r.stat_pct_of_core:.2f}",
            "-" if r.schedstat_pct_of_core is None else f"{r.schedstat_pct_of_core:.3f}",
            r.target, met_cell(r.met),
        ]
        for r in idle
    ]  # fmt: skip
    return markdown(header, rows)


def handoff_table(rows: list[HandoffRow]) -> str:
    header = ("Path", "Samples", "Missing", "p50 ms", "p90 ms", "p99 ms", "max ms",
              "p50 vs raw BLPOP", "Target", "Met")  # fmt: skip
    raw = next((r for r in rows if r.kind == "raw_blpop"), None)
    out = []
    for r in rows:
        rel = ratio(r.p50_ms, raw.p50_ms if raw else None)
        out.append(
            [
                r.label, str(r.samples), str(r.missing),
                "-" if r.p50_ms is None else f"{r.p50_ms:.3f}",
                "-" if r.p90_ms is None else f"{r.p90_ms:.3f}",
                "-" if r.p99_ms is None else f"{r.p99_ms:.3f}",
                "-" if r.max_ms is None else f"{r.max_ms:.3f}",
                _x(rel, 1), r.target, met_cell(r.met),
            ]
        )  # fmt: skip
    return markdown(header, out)


def targets_table(targets: list[Target]) -> str:
    return markdown(
        ("Target", "Measured", "Met"),
        [[t.name, t.measured, met_cell(t.met, "n/a")] for t in targets],
    )


def _git_state() -> dict[str, Any]:
    """`git_commit` and `git_dirty` (tracked files only), as far as git answers."""
    state: dict[str, Any] = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        state["git_commit"] = git("rev-parse", "HEAD", timeout_s=5)
        state["git_dirty"] = bool(git("status", "--porcelain", "--untracked-files=no", timeout_s=5))
    return state


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = base_parser(
        __doc__,
        DEFAULT_JSON,
        redis_help="Redis to use (default: a private redis-server)",
        quick_help="c=1 and 8, fewer requests",
    )
    parser.add_argument(
        "--token-delay-ms", type=float, default=20.0, help="thinker delay per token (ms)"
    )
    parser.add_argument("--tokens", type=int, default=50, help="prompt length in tokens")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error("--tokens must be >= 2")
    if args.token_delay_ms < 0:
        parser.error("--token-delay-ms must be >= 0")
    return args


def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    sizes = QUICK if args.quick else FULL
    started = time.perf_counter()
    env = environment(url) | _git_state()  # before the run: the commit the processes import
    prompt, tokens = make_prompt(args.tokens)
    with tempfile.TemporaryDirectory(prefix="bench-ttfp-") as tmp:
        path, frame_len = write_pipeline_copy(Path(tmp), args.token_delay_ms)
        expected = Expected(prompt, tokens, sum(len(t) for t in tokens) * frame_len)
        print(
            f"omni pipeline, {args.tokens}-token prompt, token_delay_ms={args.token_delay_ms:g}, "
            f"concurrency {list(sizes.concurrencies)} ({'quick' if args.quick else 'full'})",
            flush=True,
        )
        pipe = asyncio.run(bench_pipeline(url, sizes, path, expected, args.token_delay_ms))
    print("  chunk hand-off micro-benchmark ...", flush=True)
    handoff = bench_handoff(url, sizes)
    elapsed = time.perf_counter() - started
    targets = evaluate(pipe.cells, pipe.idle, handoff, sizes.concurrencies)

    print("\nLatency (ms), sequential vs streaming (async chunk):\n")
    print(latency_table(pipe.cells, sizes.concurrencies))
    for c in pipe.cells:
        for err in c.error_samples:
            print(f"  [{c.mode} c={c.concurrency}] error: {err}")
    print(f"\nIdle CPU over {sizes.idle_window_s:g} s, both pipelines up, no requests:\n")
    print(idle_table(pipe.idle))
    print(
        f"\nChunk hand-off between two processes over Redis, {sizes.handoff_chunks} chunks "
        f"every U{HANDOFF_GAP_MS} ms, first {sizes.handoff_warmup} not counted:\n"
    )
    print(handoff_table(handoff))
    print("\nTargets:\n")
    print(targets_table(targets))
    print(f"\ntotal {elapsed:.1f} s ({'quick' if args.quick else 'full'})")
    return {
        "mode": "quick" if args.quick else "full",
        "sizes": asdict(sizes),
        "config": {
            "pipeline": "workers/omni.yaml",
            "tokens": args.tokens,
            "token_delay_ms": args.token_delay_ms,
            "expected_audio_samples": expected.audio_samples,
            "namespaces": pipe.namespaces,
        },
        "environment": env,
        "elapsed_s": elapsed,
        "cells": [asdict(c) for c in pipe.cells],
        "idle_cpu": [{**asdict(r), "pct_of_core": r.pct_of_core} for r in pipe.idle],
        "handoff": [asdict(r) for r in handoff],
        "targets": [asdict(t) for t in targets],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with redis_or_private(args.redis_url, "redis-server not on PATH: pass --redis-url") as url:
        result = run(args, url)
    write_results(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
