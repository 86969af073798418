"""Two versions of the runtime, benchmarked alternately in one run: is a change neutral?

`python -m benchmarks.compare REV [--pairs 3] [--only a,b] [--full] [--redis-url URL]`
checks REV (a commit, a branch, a tag) out into a temporary worktree and runs each scenario
once in REV and once in this checkout, `--pairs` times, on one private redis-server. The
order flips from pair to pair (REV first, then this checkout first, ...) so a load that
comes and goes falls on both alike. Each row is compared as this checkout / REV: its value,
its p99 where it has one, and its same-run ratio to its baseline where it has one (the
least noisy of the three: the baseline was measured beside it). A row's verdict is the
median over the pairs. Prints a table; writes `benchmarks/results/compare.json`.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from typing import Any

from benchmarks.harness.redis import redis_for_run
from benchmarks.harness.report import RESULTS, ROOT, environment, write_json
from benchmarks.run_all import SCENARIOS, TIMEOUT_S

DEFAULT_SCENARIOS = tuple(
    name for name in SCENARIOS if name not in {"startup", "real_pipeline", "realtime"}
)
"""The runtime's own scenarios: no real model, no peer (those measure the engines), no
start-up (its imports and process starts swamp a few per cent)."""
TOLERANCE = 0.05
"""A row within 5 % of the other version (median over the pairs) is the same."""
Key = tuple[str, str, str]


def run_scenario(checkout: Path, name: str, url: str, quick: bool) -> list[dict[str, Any]]:
    """One scenario of one checkout, as its own process; its rows ([] if it failed)."""
    out = Path(tempfile.mkstemp(prefix=f"compare-{name}-", suffix=".json")[1])
    env = dict(os.environ, PYTHONPATH=str(checkout))
    cmd = [sys.executable, "-m", f"benchmarks.{name}", "--redis-url", url, "--json", str(out)]
    try:
        code = subprocess.run([*cmd, *(["--quick"] * quick)], cwd=checkout, env=env,
                              timeout=TIMEOUT_S[quick], capture_output=True).returncode  # fmt: skip
        rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"] if code == 0 else []
    except (subprocess.TimeoutExpired, OSError, ValueError, KeyError):
        rows = []
    finally:
        out.unlink(missing_ok=True)
    if not rows:
        print(f"  {name} in {checkout}: no result", flush=True)
    return rows


def measures(row: dict[str, Any]) -> dict[str, float]:
    """What a row lets us compare: its value, its p99 and its same-run ratio."""
    got = {"value": row.get("value"), "p99": row.get("p99_ms"), "ratio": row.get("ratio")}
    return {k: float(v) for k, v in got.items() if isinstance(v, int | float) and v > 0}


def compare(
    before: dict[Key, list[dict[str, float]]], after: dict[Key, list[dict[str, float]]]
) -> list[dict[str, Any]]:
    """Per row and measure: the median of after / before over the pairs."""
    out = []
    for key in sorted(before.keys() & after.keys()):
        cells: dict[str, Any] = {}
        for measure in ("value", "p99", "ratio"):
            ratios = [
                a[measure] / b[measure]
                for b, a in zip(before[key], after[key], strict=False)
                if measure in a and measure in b
            ]
            if ratios:
                cells[measure] = {"median": statistics.median(ratios), "pairs": ratios}
        out.append({"scenario": key[0], "config": key[1], "metric": key[2], **cells})
    return out


def cell(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    return f"{c['median']:.3f} [{min(c['pairs']):.2f}-{max(c['pairs']):.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("rev", help="the version to compare this checkout with")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--only", help="comma-separated scenarios")
    parser.add_argument("--full", action="store_true", help="full sizes (default: --quick)")
    parser.add_argument("--redis-url", help="Redis to use (default: a private redis-server)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(DEFAULT_SCENARIOS)
    quick = not args.full
    rows: dict[str, dict[Key, list[dict[str, float]]]] = {
        "before": defaultdict(list),
        "after": defaultdict(list),
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="omni-compare-") as tmp:
        other = Path(tmp) / "rev"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(other), args.rev],
                       cwd=ROOT, check=True)  # fmt: skip
        try:
            with redis_for_run(args.redis_url) as url:
                env = environment(url)
                for pair in range(args.pairs):
                    for name in names:
                        order = [("before", other), ("after", ROOT)]
                        for side, checkout in order if pair % 2 == 0 else order[::-1]:
                            print(f"pair {pair + 1}: {name} ({side})", flush=True)
                            for row in run_scenario(checkout, name, url, quick):
                                key = (row["scenario"], row["config"], row["metric"])
                                rows[side][key].append(measures(row))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT)
    result = compare(rows["before"], rows["after"])
    print(f"\nthis checkout / {args.rev}, median [range] over {args.pairs} pairs "
          f"({'quick' if quick else 'full'}); within {TOLERANCE:.0%} counts as the same")  # fmt: skip
    print(
        f"{'scenario':<18} {'config':<40} {'metric':<26} {'value':<20} {'p99':<20} {'same-run ratio'}"
    )
    for r in result:
        print(f"{r['scenario']:<18} {r['config'][:40]:<40} {r['metric'][:26]:<26} "
              f"{cell(r.get('value')):<20} {cell(r.get('p99')):<20} {cell(r.get('ratio'))}")  # fmt: skip
    write_json(RESULTS / "compare.json", {
        "rev": args.rev, "pairs": args.pairs, "quick": quick, "environment": env,
        "elapsed_s": time.perf_counter() - started, "rows": result,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
