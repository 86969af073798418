"""The peers comparison's cells, table and rows: omni-runtime / Ray Serve, same mode, same run.

Targets, omni-runtime streaming against Ray Serve's streaming composition at
c = 1, 8 and 32: TTFA <= 0.5x, E2E <= 0.8x, CPU per request <= 0.5x; at c = 32
throughput >= 2x and continuity at least Ray's and >= 99 %. Sequential against
sequential: E2E <= 0.8x at c = 1 and 32. Lower is better for every ratio but
throughput and continuity.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field

from benchmarks.harness.cpu import MACHINE, OTHER
from benchmarks.harness.report import Row, ratio
from benchmarks.peers.load import STEP, Samples
from omni_runtime.client.playback import AUDIBLE_GAP_S

OMNI_SYS, RAY_SYS = "omni-runtime", "Ray Serve"
JUDGED = (1, 8, 32)
STREAM_LIMITS = {"ttfa": 0.5, "e2e": 0.8, "cpu": 0.5}
"""omni / Ray at most, streaming, at every concurrency in JUDGED."""
THROUGHPUT_AT, THROUGHPUT_MIN = 32, 2.0
CONTINUITY_AT, CONTINUITY_MIN = 32, 0.99
SEQ_E2E_AT, SEQ_E2E_LIMIT = (1, 32), 0.8


@dataclass
class Cell:
    """One system in one mode at one concurrency."""

    system: str
    mode: str
    concurrency: int
    samples: Samples
    cpu_s: dict[str, float]
    """CPU seconds per process of the system over the cell, plus MACHINE and OTHER."""
    load: float = 0.0
    other_idle_s: float = 0.0
    """The other system's CPU seconds meanwhile (idle, but on the same two cores)."""
    notes: list[str] = field(default_factory=list)

    @property
    def own_cpu_s(self) -> float:
        return sum(v for k, v in self.cpu_s.items() if k not in (MACHINE, OTHER))

    @property
    def cpu_ms_per_request(self) -> float | None:
        done = self.samples.done
        return 1e3 * self.own_cpu_s / done if done else None

    @property
    def wall_s(self) -> float:
        return self.samples.wall_s

    def cpu_note(self) -> str:
        """CPU ms per request by kind of process (pids merged), biggest first; machine busy."""
        by_kind: dict[str, float] = defaultdict(float)
        for name, s in self.cpu_s.items():
            if name not in (MACHINE, OTHER):
                by_kind[re.sub(r" \d+$|-\d+$", "", name)] += s
        done = max(1, self.samples.done)
        parts = ", ".join(f"{k} {1e3 * s / done:.2f}"
                          for k, s in sorted(by_kind.items(), key=lambda kv: -kv[1]) if s > 0)  # fmt: skip
        busy = 100 * self.cpu_s.get(MACHINE, 0.0) / max(self.wall_s, 1e-9)
        idle = 100 * self.other_idle_s / max(self.wall_s, 1e-9)
        return (f"{self.system} {self.mode}: CPU ms per request: {parts}; machine {busy:.0f} % "
                f"of {os.cpu_count()} CPUs, the other system idle {idle:.1f} % of a core")  # fmt: skip


def _pair(cells: list[Cell], mode: str, conc: int) -> tuple[Cell, Cell] | None:
    """omni-runtime's cell and Ray's (Ray per-chunk against omni-runtime streaming)."""
    omni_mode = "streaming" if mode == "per-chunk" else mode
    o = [c for c in cells if (c.system, c.mode, c.concurrency) == (OMNI_SYS, omni_mode, conc)]
    r = [c for c in cells if (c.system, c.mode, c.concurrency) == (RAY_SYS, mode, conc)]
    return (o[0], r[0]) if o and r else None


def cell_table(cells: list[Cell]) -> str:
    lines = [
        "| c | mode | system | TTFT | TTFA | end to end | requests/s | no gap > 100 ms "
        "| worst gap | CPU ms / request | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        s = c.samples
        cols = [f"{s.p(m, 50) or 0:,.1f} ({s.p(m, 99) or 0:,.1f})" for m in ("ttft", "ttfa", "e2e")]
        h = s.continuity
        cols += [f"{s.throughput:.2f}", f"{h.continuous_share:.1%}",
                 f"{h.worst_gap_p50_s * 1e3:.1f} ({h.worst_gap_p99_s * 1e3:.1f})",
                 f"{c.cpu_ms_per_request or 0:.1f}", str(len(s.errors))]  # fmt: skip
        lines.append(f"| {c.concurrency} | {c.mode} | {c.system} | {' | '.join(cols)} |")
    return "\n".join(lines)


def _row(conc: int, mode: str, metric: str, unit: str, omni: float | None, ray: float | None,
         higher_better: bool = False, baseline_label: str = "", **kw: object) -> Row:  # fmt: skip
    nan = float("nan")
    return Row("peers", f"c={conc}, {mode}", metric, unit, nan if omni is None else omni,
               baseline=baseline_label or f"Ray Serve {mode}", baseline_value=ray,
               ratio=ratio(omni, ray),
               ratio_of="omni/Ray" + (" (higher is better)" if higher_better else ""),
               **kw)  # type: ignore[arg-type]  # fmt: skip


def _step_note(o: Samples, r: Samples) -> str:
    """What each system adds to the thinker's 20 ms decode step, which E2E pays 49 times."""
    steps = [s.p(STEP, 50) for s in (o, r)]
    if None in steps:
        return "thinker step period: not measured"
    return (f"thinker step period as the client sees it, p50: omni {steps[0]:.2f} ms, "
            f"Ray {steps[1]:.2f} ms")  # fmt: skip


def _verdict(r: float | None, limit: float, ok: bool, at_most: bool = True) -> bool:
    return ok and r is not None and (r <= limit if at_most else r >= limit)


def rows(cells: list[Cell]) -> list[Row]:
    out: list[Row] = []
    concs = sorted({c.concurrency for c in cells})
    for mode in ("streaming", "sequential"):
        for conc in concs:
            pair = _pair(cells, mode, conc)
            if pair is None:
                continue
            out += _mode_rows(mode, conc, *pair)
    for conc in concs:
        if (pair := _pair(cells, "per-chunk", conc)) is not None:
            o, r = pair
            out += [_row(conc, "streaming", f"{m.upper()} p50", "ms", o.samples.p(m, 50),
                         r.samples.p(m, 50), baseline_label="Ray Serve per-chunk calls")
                    for m in ("ttfa", "e2e")]  # fmt: skip
            out.append(_row(conc, "streaming", "CPU per request", "ms", o.cpu_ms_per_request,
                            r.cpu_ms_per_request, baseline_label="Ray Serve per-chunk calls",
                            notes=[r.cpu_note()]))  # fmt: skip
    return out


def _mode_rows(mode: str, conc: int, o: Cell, r: Cell) -> list[Row]:
    os_, rs = o.samples, r.samples
    ok = not os_.errors
    errors = [f"{c.system}: {len(c.samples.errors)} of {c.samples.done + len(c.samples.errors)} "
              f"failed, e.g. {c.samples.errors[0]}" for c in (o, r) if c.samples.errors]  # fmt: skip
    streaming = mode == "streaming"
    out = []
    for metric in ("ttft", "ttfa", "e2e"):
        limit = None
        if streaming and conc in JUDGED:
            limit = STREAM_LIMITS.get(metric)
        elif not streaming and metric == "e2e" and conc in SEQ_E2E_AT:
            limit = SEQ_E2E_LIMIT
        row = _row(conc, mode, f"{metric.upper()} p50", "ms", os_.p(metric, 50), rs.p(metric, 50),
                   p50_ms=os_.p(metric, 50), p99_ms=os_.p(metric, 99),
                   notes=[f"Ray p99 {rs.p(metric, 99) or float('nan'):,.1f} ms"] + (
                       errors if metric == "ttft" else []) + (
                       [_step_note(os_, rs)] if metric == "e2e" else []),
                   details={"ray_p99_ms": rs.p(metric, 99), "requests": os_.done,
                            "ray_requests": rs.done})  # fmt: skip
        if limit is not None:
            row.target, row.met = f"omni/Ray <= {limit:g}x", _verdict(row.ratio, limit, ok)
        out.append(row)
    tput = _row(conc, mode, "requests/s", "/s", os_.throughput, rs.throughput, True,
                notes=[f"closed loop, {os_.done} / {rs.done} requests over "
                       f"{os_.wall_s:.1f} / {rs.wall_s:.1f} s"])  # fmt: skip
    if streaming and conc == THROUGHPUT_AT:
        tput.target = f"omni/Ray >= {THROUGHPUT_MIN:g}x"
        tput.met = _verdict(tput.ratio, THROUGHPUT_MIN, ok, at_most=False)
    out.append(tput)
    if streaming:
        out += _continuity_rows(conc, o, r, ok)
    cpu = _row(conc, mode, "CPU per request", "ms", o.cpu_ms_per_request, r.cpu_ms_per_request,
               notes=[o.cpu_note(), r.cpu_note()],
               details={"omni_cpu_s": o.cpu_s, "ray_cpu_s": r.cpu_s})  # fmt: skip
    if streaming and conc in JUDGED:
        limit = STREAM_LIMITS["cpu"]
        cpu.target, cpu.met = f"omni/Ray <= {limit:g}x", _verdict(cpu.ratio, limit, ok)
    out.append(cpu)
    return out


def _continuity_rows(conc: int, o: Cell, r: Cell, ok: bool) -> list[Row]:
    h, base = o.samples.continuity, r.samples.continuity
    share = _row(conc, "streaming", f"no gap > {AUDIBLE_GAP_S * 1e3:g} ms", "%",
                 100 * h.continuous_share, 100 * base.continuous_share, True,
                 notes=[f"total stall {h.stall_s:.2f} s over {h.requests} requests "
                        f"(Ray: {base.stall_s:.2f} s over {base.requests})"],
                 details={"stall_s": h.stall_s, "ray_stall_s": base.stall_s})  # fmt: skip
    if conc == CONTINUITY_AT:
        share.target = f">= Ray's and >= {CONTINUITY_MIN:.0%}"
        share.met = ok and h.continuous_share >= max(CONTINUITY_MIN, base.continuous_share)
    gap = _row(conc, "streaming", "worst gap p50", "ms", h.worst_gap_p50_s * 1e3,
               base.worst_gap_p50_s * 1e3, p50_ms=h.worst_gap_p50_s * 1e3,
               p99_ms=h.worst_gap_p99_s * 1e3,
               notes=[f"Ray worst gap p99 {base.worst_gap_p99_s * 1e3:.1f} ms"])  # fmt: skip
    return [share, gap]
