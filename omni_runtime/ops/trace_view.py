"""`omni-runtime trace REQUEST_ID`: one request's timeline, read from Redis (OMNI_TRACE=1).

A table of every stamp (time since the first, gap since the previous), a
per-stage summary, optionally a Gantt-style PNG (`--png`, needs matplotlib) and
an OpenTelemetry export (`--otel`, needs opentelemetry-sdk and
OTEL_EXPORTER_OTLP_ENDPOINT). Times are wall-clock ns from every process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from omni_runtime.errors import ConfigError
from omni_runtime.observe.tracing import Flushable, Stamp, read_redis_trace
from omni_runtime.ops.flags import add_trace_arguments as add_trace_arguments
from omni_runtime.settings import Settings

MAX_LABELLED = 80
"""Stamps named in the PNG; a longer timeline is drawn one row per lane, unlabelled."""


def _lane(stage: int | None) -> str:
    return "request" if stage is None else f"stage {stage}"


def stage_spans(stamps: list[Stamp]) -> list[tuple[str, int, int]]:
    """`(lane, first t_ns, last t_ns)` per lane, in order of first appearance."""
    spans: dict[str, list[int]] = {}
    for _event, _rid, stage, t in stamps:
        span = spans.setdefault(_lane(stage), [t, t])
        span[0], span[1] = min(span[0], t), max(span[1], t)
    return [(lane, a, b) for lane, (a, b) in spans.items()]


def timeline_table(request_id: str, stamps: list[Stamp]) -> Table:
    t0 = stamps[0][3]
    table = Table(title=f"request {request_id}: {len(stamps)} stamps", title_justify="left")
    for col in ("t (ms)", "Δ (ms)", "stage", "event"):
        table.add_column(col, justify="right" if col != "event" else "left")
    prev = t0
    for event, _rid, stage, t in stamps:
        table.add_row(
            f"{(t - t0) / 1e6:.3f}",
            f"{(t - prev) / 1e6:.3f}",
            "-" if stage is None else str(stage),
            event,
        )
        prev = t
    return table


def summary_table(stamps: list[Stamp]) -> Table:
    t0 = stamps[0][3]
    table = Table(title="per stage", title_justify="left")
    for col in ("lane", "first (ms)", "last (ms)", "span (ms)"):
        table.add_column(col, justify="left" if col == "lane" else "right")
    for lane, a, b in stage_spans(stamps):
        table.add_row(
            lane, f"{(a - t0) / 1e6:.3f}", f"{(b - t0) / 1e6:.3f}", f"{(b - a) / 1e6:.3f}"
        )
    return table


def draw_gantt(request_id: str, stamps: list[Stamp], path: Path) -> None:
    """A waterfall: per lane a bar from its first to its last stamp, one labelled row per stamp."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = stamps[0][3]
    end_ms = max((stamps[-1][3] - t0) / 1e6, 1e-3)
    label = len(stamps) <= MAX_LABELLED  # past that the table has the names
    rows_per_lane: dict[str, list[Stamp]] = {}
    for stamp in stamps:
        rows_per_lane.setdefault(_lane(stamp[2]), []).append(stamp)
    n_rows = len(stamps) if label else len(rows_per_lane)
    fig, ax = plt.subplots(figsize=(12, 1.5 + 0.28 * n_rows), dpi=110)
    colors = plt.get_cmap("tab10")
    y, ticks = 0.0, []
    for i, (lane, lane_stamps) in enumerate(rows_per_lane.items()):
        a, b = (lane_stamps[0][3] - t0) / 1e6, (lane_stamps[-1][3] - t0) / 1e6
        height = len(lane_stamps) if label else 1
        ax.broken_barh(
            [(a, max(b - a, end_ms / 500))],
            (y - 0.45, height - 0.1),
            color=colors(i % 10),
            alpha=0.35,
        )
        ticks.append((y + (height - 1) / 2, lane))
        for j, (event, _rid, _stage, t) in enumerate(lane_stamps):
            x = (t - t0) / 1e6
            row = y + j if label else y
            ax.plot(x, row, marker="|", markersize=9, color="black")
            if label:
                ax.text(x + end_ms * 0.006, row, f"{event}  {x:.2f} ms", fontsize=8, va="center")
        y += height
    ax.set_yticks([t for t, _ in ticks], [name for _, name in ticks])
    ax.set_ylim(y - 0.4, -0.6)
    ax.set_xlim(-end_ms * 0.02, end_ms * 1.2)
    ax.set_xlabel("ms since the first stamp (wall clock)")
    ax.set_title(f"request {request_id}")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_trace(
    args: argparse.Namespace,
    settings: Settings,
    client: redis.Redis | None = None,
    console: Console | None = None,
    tracer_provider: Any = None,
) -> int:
    """The `trace` subcommand; 1 when Redis holds no trace of the request."""
    if client is None:
        from omni_runtime.ops.status import connect

        client = connect(settings)
    if console is None:
        console = Console(width=None if sys.stdout.isatty() else 120)
    stamps = read_redis_trace(client, settings.names, args.request_id)
    if not stamps:
        console.print(
            f"no trace of {args.request_id} in {settings.names.trace(args.request_id)}"
            " (was OMNI_TRACE=1 set on the processes? traces expire after OMNI_TRACE_TTL_S)"
        )
        return 1
    if args.json:
        rows = [{"event": e, "stage": s, "t_wall_ns": t} for e, _r, s, t in stamps]
        console.file.write(json.dumps(rows) + "\n")
    else:
        console.print(timeline_table(args.request_id, stamps))
        console.print(summary_table(stamps))
    if args.png:
        draw_gantt(args.request_id, stamps, Path(args.png))
        console.print(f"wrote {args.png}")
    if args.otel:
        _export(args.request_id, stamps, tracer_provider)
    return 0


def _export(request_id: str, stamps: list[Stamp], provider: Any) -> None:
    try:
        from omni_runtime.observe.otel import export_stamps
    except ImportError as e:
        raise ConfigError("--otel needs opentelemetry: pip install 'omni-runtime[observe]'") from e
    if provider is None:
        from omni_runtime.observe.otel import otel_tracer_from_env

        otel = otel_tracer_from_env("trace")
        if otel is None:
            raise ConfigError("--otel needs OTEL_EXPORTER_OTLP_ENDPOINT and omni-runtime[observe]")
        provider = otel.provider
    export_stamps(provider, request_id, stamps)
    if isinstance(provider, Flushable):
        provider.force_flush()
