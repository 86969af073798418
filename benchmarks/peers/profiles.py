"""Where each system's time goes: py-spy over one more cell per system in `CELLS`.

Every Python process that does the work is sampled at once (omni-runtime: the
orchestrator and the three workers; Ray Serve: the mode's replicas and the Serve
controller); the collapsed stacks go to
`benchmarks/results/peers_profile/<system>-<mode>-c<C>-<process>.folded`, and one row per
system and mode notes each process's busy samples and its top self-time frames. The
cells' own figures are not compared: py-spy's sampling costs CPU on the same two cores.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from benchmarks.harness import scenario
from benchmarks.harness.profile import Profiler, top_self
from benchmarks.harness.report import RESULTS, Row
from benchmarks.peers.report import OMNI_SYS, RAY_SYS

if TYPE_CHECKING:
    from benchmarks.peers.__main__ import Systems

CELLS = (("streaming", 1, 10), ("streaming", 32, 96), ("sequential", 32, 96))
"""(mode, concurrency, requests): light load, where both sit on the engines' pacing, and
the load where they part."""
OUT = RESULTS / "peers_profile"


def _targets(systems: Systems, system: str, mode: str) -> dict[str, int]:
    if system == OMNI_SYS:
        return systems.omni[mode].pids()
    ours = re.compile(rf"ray::(ServeReplica:{mode}:|ServeController)")
    return {re.sub(rf"^ray::(ServeReplica:{mode}:)?| \d+$", "", name): pid
            for name, pid in systems.ray_pids().items() if ours.match(name)}  # fmt: skip


async def profile_cells(systems: Systems, ctx: scenario.Context) -> list[Row]:
    if (why := Profiler().available) is not None:
        return [Row("peers", "profile", "not taken", "", float("nan"), notes=[why])]
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for (mode, conc, n), system in ((c, s) for c in CELLS for s in (OMNI_SYS, RAY_SYS)):
        running: dict[str, tuple[Profiler, Any]] = {}
        for name, pid in _targets(systems, system, mode).items():
            path = OUT / f"{system.split()[0].lower()}-{mode}-c{conc}-{name}.folded"
            prof = Profiler()
            prof.start(pid, path, "raw")
            running[name] = (prof, path)
        cell = await systems.cell(system, mode, conc, n)
        notes = []
        for name, (prof, path) in running.items():
            err = prof.stop()
            if err is not None or not path.exists():
                notes.append(f"{name}: {err or 'no profile written'}")
                continue
            busy, top = top_self(path, 6)
            frames = "; ".join(f"{frame} {share:.1f} %" for frame, share in top)
            notes.append(f"{name}: {busy} busy samples; top self: {frames}")
        notes.append(cell.cpu_note())
        rows.append(Row("peers", f"profile, c={conc} {mode}", f"{system}: processes sampled", "",
                        float(len(running)), notes=notes,
                        details={"folded": str(OUT), "errors": len(cell.samples.errors)}))  # fmt: skip
    return rows
