"""CPU time of processes and of the machine, from /proc (Linux).

`/proc/<pid>/stat` counts 10 ms ticks (0.33 % of a core over 3 s), too coarse for
idle processes, so the on-CPU ns of every thread (`task/*/schedstat`) are read too.
"""

from __future__ import annotations

import os
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
MACHINE = "machine (all CPUs)"
OTHER = "other (kernel, this coordinator, ...)"
SHARED_MACHINE_FRACTION = 0.15
"""More "other" CPU than this (of one core) means something else ran on the machine."""


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def proc_cpu_ns(pid: int) -> int | None:
    """On-CPU ns summed over the process's threads (`schedstat`), or None if unavailable."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just exited
    return total if tasks else None


def machine_busy_s() -> float:
    """Busy CPU seconds of all CPUs since boot (`/proc/stat`)."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(parts[:8]) - parts[3] - parts[4]) * TICK_S


class CpuSampler:
    """CPU seconds each named process used between `start` and `stop`, and the machine's."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._c0: dict[str, float | None] = {}
        self._m0 = 0.0

    def start(self) -> None:
        self._c0 = {name: _cpu(pid) for name, pid in self.pids.items()}
        self._m0 = machine_busy_s()

    def stop(self) -> dict[str, float]:
        """Seconds per process, plus MACHINE (all busy CPU) and OTHER (not the named ones)."""
        machine = machine_busy_s() - self._m0
        out: dict[str, float] = {}
        for name, pid in self.pids.items():
            c0, c1 = self._c0.get(name), _cpu(pid)
            if c0 is not None and c1 is not None:
                out[name] = c1 - c0
        out[OTHER] = max(0.0, machine - sum(out.values()))
        out[MACHINE] = machine
        return out


def _cpu(pid: int) -> float | None:
    ns = proc_cpu_ns(pid)
    return ns / 1e9 if ns is not None else proc_cpu_s(pid)


def proc_wakes(pid: int) -> int | None:
    """Times the process's threads went to sleep and were woken (voluntary context
    switches, summed over `task/*/status`), or None if it is gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # a thread that just exited
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total if tasks else None


def process_tree(root: int) -> dict[str, int]:
    """`root` and every descendant alive now, named by their command line (Ray titles its
    workers `ray::<what>`), `<name> <pid>` so each stays apart: all the processes of a
    system that one process started (`/proc/*/stat`'s parent pids)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out: dict[str, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        out[f"{_proc_name(pid)} {pid}"] = pid
        todo += children.get(pid, [])
    return out


def _proc_name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace")
    if first.startswith("ray::"):
        return first.split()[0]
    if Path(first).name.startswith("python") and len(argv) > 1:
        args = [a.decode(errors="replace") for a in argv[1:] if a]
        if args[:1] == ["-c"]:
            return "python -c"
        script = next((a for a in args if not a.startswith("-")), "")
        return Path(script).name or "python"
    return Path(first).name
