"""CPU caps for benchmark processes: one cgroup per process, its CFS quota a share of a core.

A capped process is the limit, as it would be on a machine with more cores than
processes, so capacity that grows with processes can be measured on a small one.
cgroup v2 (`cgroup.controllers` at the root): `<root>/<group>/cpu.max` = "quota
period". cgroup v1 (the `cpu` controller mounted at `/sys/fs/cgroup/cpu`):
`cpu.cfs_quota_us` and `cpu.cfs_period_us`. Moving a process (`cgroup.procs`) moves
all its threads; on `release` they go back to the root group and the groups are
removed. Needs root (or a delegated subtree).

A quota is a ceiling, not a guarantee: on a machine busy with other work a capped
process may get less. So every group also gets a high weight (v1 `cpu.shares`, v2
`cpu.weight`), and `prioritise` gives the benchmark's other processes (Redis, clients,
the stages not under test) a group of the same weight with no quota: the benchmark's
processes win the machine over other work, and only the caps limit them.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
WEIGHT_V1 = 10_240
"""cpu.shares of a benchmark group: ten times a plain task's (1024)."""
WEIGHT_V2 = 1_000
"""cpu.weight of a benchmark group: ten times the default (100)."""


def cpu_root() -> tuple[Path, int] | None:
    """(the cpu controller's root directory, cgroup version), None if neither is usable."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        controllers = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
        return (CGROUP_ROOT, 2) if "cpu" in controllers else None
    v1 = CGROUP_ROOT / "cpu"
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, 1
    return None


def unavailable() -> str | None:
    """Why processes cannot be capped here, or None."""
    found = cpu_root()
    if found is None:
        return f"no cgroup cpu controller under {CGROUP_ROOT}"
    root, _version = found
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (run as root)"
    return None


class CpuCaps:
    """`cap(pid, cores)`: the process alone in a new group limited to `cores` of a core."""

    def __init__(self, prefix: str = "omni-bench") -> None:
        found = cpu_root()
        if found is None:
            raise RuntimeError(f"no cgroup cpu controller under {CGROUP_ROOT}")
        self.root, self.version = found
        if self.version == 2:  # children of the root get the cpu controller
            control = self.root / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
        self.prefix = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.groups: dict[int, Path] = {}

    def cap(self, pid: int, cores: float | None) -> None:
        """`pid` alone in a group of high weight, limited to `cores` (None: no limit)."""
        group = self.root / f"{self.prefix}-{pid}"
        group.mkdir(exist_ok=True)
        if self.version == 2:
            (group / "cpu.weight").write_text(str(WEIGHT_V2))
        else:
            (group / "cpu.shares").write_text(str(WEIGHT_V1))
        if cores is not None:
            quota = max(1000, int(cores * PERIOD_US))
            if self.version == 2:
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(pid))
        self.groups[pid] = group

    def prioritise(self, pid: int) -> None:
        """`pid` in a group of the capped ones' weight, with no limit."""
        self.cap(pid, None)

    def throttled_s(self, pid: int) -> float:
        """Time the process's group spent throttled so far (cpu.stat), in seconds."""
        stat = dict(
            line.split() for line in (self.groups[pid] / "cpu.stat").read_text().splitlines()
        )
        if self.version == 2:
            return int(stat.get("throttled_usec", 0)) / 1e6
        return int(stat.get("throttled_time", 0)) / 1e9

    def release(self) -> None:
        """Every capped process back to the root group (if alive), the groups removed."""
        for group in self.groups.values():
            try:
                for task in (group / "cgroup.procs").read_text().split():
                    (self.root / "cgroup.procs").write_text(task)
            except OSError:
                pass  # gone meanwhile
            with contextlib.suppress(OSError):
                group.rmdir()
        self.groups = {}
