"""One row type, one table layout, one JSON schema (with one git-state schema) for every scenario.

A row is one measured value next to its same-run baseline, the ratio between them,
the target and whether it was met. JSON: `{"scenario", "quick", "sizes",
"environment": {..., "git": {"commit", "dirty"}}, "elapsed_s", "rows": [Row...]}`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from benchmarks.harness.redis import server_version

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


@dataclass
class Row:
    """One measurement: value (median over repetitions, [lo..hi] their range) vs baseline."""

    scenario: str
    config: str
    metric: str
    unit: str
    value: float
    lo: float | None = None
    hi: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    baseline: str = ""
    baseline_value: float | None = None
    ratio: float | None = None
    """value / baseline_value unless the scenario says otherwise in `ratio_of`."""
    ratio_of: str = ""
    target: str = ""
    met: bool | None = None
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is not positive."""
    if a is None or b is None or b <= 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def fmt(x: float | None, unit: str) -> str:
    """A number in its unit, rates with a k suffix: `12.3k/s`, `0.66 ms`, `0.14 %`."""
    if x is None or math.isnan(x):
        return "-"
    if unit == "/s":
        return f"{x / 1e3:,.2f}k/s" if x >= 1e3 else f"{x:,.1f}/s"
    if unit == "ms":
        return f"{x:,.3f} ms" if x < 10 else f"{x:,.1f} ms"
    if unit == "us":
        return f"{x:,.0f} us"
    if unit == "%":
        return f"{x:.3f} %"
    return f"{x:,.3g} {unit}".rstrip()


def met_cell(met: bool | None) -> str:
    """A verdict as a cell; "NO" in capitals so a miss stands out."""
    return {None: "", True: "yes", False: "NO"}[met]


HEADER: tuple[str, ...] = (
    *("scenario", "config", "metric", "value [min..max]", "p50", "p99"),
    *("baseline (same run)", "ratio", "target", "met"),
)


def table(rows: Sequence[Row], notes: bool = True) -> str:
    """Rows as an aligned plain-text table, then their notes."""
    lines: list[tuple[str, ...]] = [HEADER]
    for r in rows:
        spread = "" if r.lo is None else f" [{fmt(r.lo, r.unit)}..{fmt(r.hi, r.unit)}]"
        base = "" if r.baseline_value is None else f"{r.baseline}: {fmt(r.baseline_value, r.unit)}"
        lines.append(
            (
                r.scenario,
                r.config,
                r.metric,
                fmt(r.value, r.unit) + spread,
                fmt(r.p50_ms, "ms") if r.p50_ms is not None else "",
                fmt(r.p99_ms, "ms") if r.p99_ms is not None else "",
                base,
                ""
                if r.ratio is None
                else f"{r.ratio:.2f}x" + (f" ({r.ratio_of})" * bool(r.ratio_of)),
                r.target,
                met_cell(r.met),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    if notes:
        extra = [f"  [{r.scenario} | {r.config}] {note}" for r in rows for note in r.notes]
        if extra:
            out += ["", "notes:", *extra]
    return "\n".join(out)


def git_state() -> dict[str, Any]:
    """`{"commit": sha or None, "dirty": tracked or untracked changes, or None}`."""
    try:

        def git(*args: str) -> str:
            cmd = ["git", "-C", str(ROOT), *args]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=True)
            return done.stdout.strip()

        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def environment(redis_url: str | None) -> dict[str, Any]:
    """What the figures depend on, so runs on different machines can be told apart."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "redis_py": redis.__version__,
        "redis_server": server_version(redis_url) if redis_url else None,
        "git": git_state(),
    }


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"results written to {path}")


def rows_to_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def rows_from_json(items: Sequence[dict[str, Any]]) -> list[Row]:
    return [Row(**item) for item in items]
