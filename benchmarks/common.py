"""Helpers shared by the benchmark scripts (bench_core, bench_e2e, bench_ttfp).

The scripts are run as ``python benchmarks/bench_x.py``, so this file is imported as the
sibling module ``common`` (the script's directory is first on ``sys.path``). Everything here
used to be copied into each script; one copy keeps the statistics, the private Redis and the
output format the same across the three and their JSON files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from omni_runtime.launcher import free_port

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: pipelines under ``workers/`` and ``git`` are found from here."""


# --- statistics -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence.

    Nearest rank, not interpolation: every figure reported is a sample that was measured.
    """
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100.0 * len(ordered) + 0.5)))
    return ordered[rank - 1]


@dataclass
class Summary:
    """Median and range over the repetitions of one measurement (the table's main cell)."""

    median: float
    min: float
    max: float
    values: list[float]

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        vals = list(values)
        return cls(statistics.median(vals), min(vals), max(vals), vals)


@dataclass
class Row:
    """One line of the table and one object of the JSON file."""

    bench: str
    config: str
    metric: str
    unit: str
    value: Summary
    p50_ms: float | None = None
    p99_ms: float | None = None
    baseline: str = ""
    baseline_value: float | None = None
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    notes: list[str] = field(default_factory=list)


# --- output -----------------------------------------------------------------------------------


def met_cell(met: bool | None, unknown: str = "") -> str:
    """A target's verdict as a table cell; "NO" in capitals so a miss stands out."""
    return {None: unknown, True: "yes", False: "NO"}[met]


def format_table(
    rows: Sequence[Row],
    number: Callable[[float, str], str],
    baseline: Callable[[float, str], str],
) -> str:
    """Rows as an aligned plain-text table followed by their notes.

    `number(value, unit)` writes the median/min/max, `baseline(value, unit)` the baseline
    cell: each script keeps its own number format while the layout stays the same.
    """
    header = (
        "bench",
        "config",
        "metric: median [min..max]",
        "p50 ms",
        "p99 ms",
        "baseline",
        "ratio",
        "target",
        "met",
    )
    lines: list[tuple[str, ...]] = [header]
    for r in rows:
        v = r.value
        lines.append(
            (
                r.bench,
                r.config,
                f"{number(v.median, r.unit)} {r.metric} "
                f"[{number(v.min, r.unit)}..{number(v.max, r.unit)}]",
                "" if r.p50_ms is None else f"{r.p50_ms:.3f}",
                "" if r.p99_ms is None else f"{r.p99_ms:.3f}",
                "" if r.baseline_value is None else baseline(r.baseline_value, r.unit),
                "" if r.ratio is None else f"{r.ratio:.2f}x",
                r.target,
                met_cell(r.met),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    notes = [f"  [{r.bench} | {r.config}] {note}" for r in rows for note in r.notes]
    return "\n".join([*out, "", "notes:", *notes])


def write_results(path: Path, result: dict[str, Any]) -> None:
    """The run's JSON file (parent folders made), and a line saying where it went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {path}")


# --- command line -----------------------------------------------------------------------------


def base_parser(
    doc: str | None, default_json: Path, redis_help: str, quick_help: str
) -> argparse.ArgumentParser:
    """The options every benchmark takes: --redis-url, --quick and --json, in that order."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--redis-url", default=None, help=redis_help)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", type=Path, default=default_json, help="where to write results")
    return parser


# --- redis-server -----------------------------------------------------------------------------


def ping(url: str) -> bool:
    """One PING with short timeouts; False (not an exception) while the server is not up."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; always reaped."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def private_redis_server() -> Iterator[str | None]:
    """A redis-server on a free loopback port, no persistence, for the run's duration.

    Yields its URL, or None if redis-server is not on PATH (the caller decides whether to
    skip Redis or stop). Not `omni_runtime.launcher.local_redis`: that one falls back to an
    embedded fakeredis, which would change what is measured. The start-up loop is not
    `omni_runtime.launcher.wait_for_ping` either, as it also fails at once if the server exits.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10.0
        while not ping(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start")
            time.sleep(0.02)
        yield url
    finally:
        stop_process(proc)


@contextlib.contextmanager
def redis_or_private(url: str | None, missing: str) -> Iterator[str]:
    """`url` if one was given, else a private redis-server's for the duration.

    For the benchmarks that cannot run without Redis: SystemExit(`missing`) if there is
    neither a URL nor a redis-server on PATH.
    """
    if url:
        yield url
        return
    with private_redis_server() as private:
        if private is None:
            raise SystemExit(missing)
        yield private


def delete_keys(url: str, pattern: str) -> None:
    """UNLINK every key matching `pattern` (a run's namespace); Redis errors are ignored.

    Best effort clean-up after a run, so a shared Redis does not keep the benchmark's keys.
    """
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=pattern, count=1000):
            client.unlink(key)
    except redis.RedisError:
        pass
    finally:
        client.close()


def redis_server_pid(url: str, names: tuple[str, ...] = ()) -> int | None:
    """The server's pid when it runs on this machine (its INFO process_id exists here).

    With `names`, the process's ``/proc/<pid>/comm`` must also contain one of them, so a
    remote server's pid that happens to exist here is not taken for it.
    """
    client = redis.Redis.from_url(url)
    try:
        pid = int(client.info("server").get("process_id", 0))
    except (redis.RedisError, ValueError):
        return None
    finally:
        client.close()
    if not names:
        return pid if pid and Path(f"/proc/{pid}").exists() else None
    try:
        comm = Path(f"/proc/{pid}/comm").read_text() if pid else ""
    except OSError:
        return None
    return pid if any(name in comm for name in names) else None


# --- CPU accounting ---------------------------------------------------------------------------

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
"""Length of the clock tick ``/proc/<pid>/stat`` counts CPU time in."""


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


# --- environment ------------------------------------------------------------------------------


def environment(redis_url: str | None, **extra: Any) -> dict[str, Any]:
    """What the figures depend on: Python, platform, CPUs, redis-py, then `extra`, then the
    server's version (when there is a server), so runs on different machines can be told apart.
    """
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "redis_py": redis.__version__,
        **extra,
    }
    if redis_url is not None:
        client = redis.Redis.from_url(redis_url)
        try:
            env["redis_server"] = client.info("server").get("redis_version")
        finally:
            client.close()
    return env


def git(*args: str, timeout_s: float | None = None) -> str:
    """Stripped stdout of ``git -C ROOT <args>``; raises OSError or SubprocessError."""
    cmd = ["git", "-C", str(ROOT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s).stdout.strip()
