"""Every scenario, one after the other, on one private redis-server; one summary and one JSON.

`python benchmarks/run_all.py [--quick] [--redis-url URL] [--only a,b] [--peers]`. Each scenario
runs as its own process (`python -m benchmarks.<name>`: a crash or a hang stays in
it), prints its own table and writes `benchmarks/results/<name>.json`; then this
prints every row in one table and writes `benchmarks/results/run_all.json`.
Exit status 1 if a scenario failed to run (a missed target is not a failure).
`--peers` adds `peers` (omni-runtime against Ray Serve), which needs the optional
`peers` extra (`pip install -e '.[peers]'`); without it that scenario fails, saying so.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import subprocess
import time
from typing import Any

from benchmarks.harness.redis import redis_for_run
from benchmarks.harness.report import (
    RESULTS,
    ROOT,
    environment,
    met_cell,
    rows_from_json,
    table,
    write_json,
)

SCENARIOS = (
    "core_orchestrator",
    "core_adapter",
    "throughput",
    "hops",
    "durability",
    "long_outputs",
    "orchestrators",
    "handoff",
    "ttfp",
    "idle_cpu",
    "startup",
    "real_pipeline",
    "realtime",
    "speech_stream",
    "tool_calls",
    "text_only",
    "soak",
)
PEERS = "peers"
"""Only with --peers: Ray Serve is an optional extra, not installed by default."""
TIMEOUT_S = {True: 300.0, False: 1200.0}
"""Longest run of one scenario, quick / full."""
LONGER_S = {PEERS: 3.0, "soak": 1.5}
"""Scenarios that run longer than most, by how many times: peers starts Ray and runs
four deployments' cells at four concurrencies; soak's length is its point."""


def run_one(name: str, url: str, quick: bool) -> tuple[bool, float, dict[str, Any] | None]:
    """(ran to completion, seconds, its JSON result)."""
    path = RESULTS / f"{name}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", f"benchmarks.{name}", "--redis-url", url, "--json", str(path)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    print(f"\n=== {name} ===", flush=True)
    t0 = time.perf_counter()
    timeout_s = TIMEOUT_S[quick] * LONGER_S.get(name, 1.0)
    try:
        code = subprocess.run([*cmd, *(["--quick"] * quick)], cwd=ROOT, env=env,
                              timeout=timeout_s).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"{name}: did not finish within {timeout_s:g} s", flush=True)
        code = -1
    elapsed = time.perf_counter() - t0
    result = json.loads(path.read_text()) if code == 0 and path.exists() else None
    return result is not None, elapsed, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="every scenario's smaller sizes")
    parser.add_argument("--redis-url", help="Redis to use (default: a private redis-server)")
    parser.add_argument("--only", help="comma-separated scenarios (default: all)")
    parser.add_argument("--peers", action="store_true",
                        help="also omni-runtime against Ray Serve (needs pip install -e '.[peers]')")  # fmt: skip
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(SCENARIOS)
    if args.peers and PEERS not in names:
        names.append(PEERS)
    unknown = set(names) - {*SCENARIOS, PEERS}
    if unknown:
        parser.error(
            f"unknown scenarios: {sorted(unknown)}; known: {', '.join(SCENARIOS)}, {PEERS}"
        )
    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    with redis_for_run(args.redis_url) as url:
        env = environment(url)
        for name in names:
            ok, elapsed, result = run_one(name, url, args.quick)
            runs[name] = {"ok": ok, "elapsed_s": elapsed, "rows": (result or {}).get("rows", [])}
    total = time.perf_counter() - started
    rows = [row for r in runs.values() for row in rows_from_json(r["rows"])]
    print("\n=== summary ===\n" + table(rows, notes=False) + "\n")
    for name, r in runs.items():
        print(f"  {name:<18} {'ran' if r['ok'] else 'FAILED':<7} {r['elapsed_s']:6.1f} s")
    missed = [f"{r.scenario} | {r.config} | {r.metric}" for r in rows if r.met is False]
    print(f"\n{len(rows)} rows, targets met: {sum(r.met is True for r in rows)}, "
          f"missed: {len(missed)} ({met_cell(False)} above); total {total:.1f} s "
          f"({'quick' if args.quick else 'full'})")  # fmt: skip
    write_json(RESULTS / "run_all.json", {
        "quick": args.quick, "environment": env, "elapsed_s": total, "scenarios": runs,
    })  # fmt: skip
    return 0 if all(r["ok"] for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
