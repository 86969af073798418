"""The command line and life cycle every scenario shares.

`python -m benchmarks.<scenario> [--quick] [--redis-url URL] [--json PATH]`: start a
private redis-server unless given one, run, print the table, write the JSON.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.harness.redis import redis_for_run
from benchmarks.harness.report import RESULTS, Row, environment, rows_to_json, table, write_json

S = TypeVar("S")


@dataclass
class Context:
    """What a scenario's `run` gets besides its sizes."""

    redis_url: str
    quick: bool
    log_dir: Path
    """Logs of the processes it starts (a temp dir, removed after the run)."""


def main(
    name: str,
    doc: str | None,
    run: Callable[[Context, S], list[Row]],
    full: S,
    quick: S,
    argv: Sequence[str] | None = None,
) -> int:
    """Parse the shared options, run the scenario once, print its table, write its JSON."""
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}", description=(doc or "").split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run")
    parser.add_argument("--redis-url", help="Redis to use (default: a private redis-server)")
    parser.add_argument("--json", type=Path, default=RESULTS / f"{name}.json")
    args = parser.parse_args(argv)
    sizes = quick if args.quick else full
    started = time.perf_counter()
    with redis_for_run(args.redis_url) as url, tempfile.TemporaryDirectory() as tmp:
        env = environment(url)  # before the run: the commit the processes import
        rows = run(Context(url, args.quick, Path(tmp)), sizes)
    elapsed = time.perf_counter() - started
    print(table(rows))
    print(f"\n{name}: {elapsed:.1f} s ({'quick' if args.quick else 'full'})")
    result: dict[str, Any] = {
        "scenario": name,
        "quick": args.quick,
        "sizes": asdict(sizes) if is_dataclass(sizes) and not isinstance(sizes, type) else sizes,
        "environment": env,
        "elapsed_s": elapsed,
        "rows": rows_to_json(rows),
    }
    write_json(args.json, result)
    return 0
