"""Start-up and shutdown of `omni-runtime run`, as a user sees them, for the bundled demos.

Each repetition launches `omni-runtime run --pipeline workers/<demo>.yaml PROMPT` as a
subprocess (its own private redis-server, as on a fresh machine) and stamps its stdout
lines as they arrive:

- start-up: launch -> the first output of the pipeline printed (`[ ... ms] stage ...`);
- shutdown: the last output printed -> the command has exited and every process it
  started (workers, orchestrator, redis-server) is gone;
- Ctrl-C: SIGINT to the command's process group (what a terminal sends) while the
  request still streams -> every process gone.

The phases of start-up, from what `run` prints: launch -> its `pipeline ... on ...` line
(interpreter, imports, the stage code checked, Redis answering); -> the submit (forks,
every stage ready; the first output line gives its time since the submit); -> the first
output. Python runs with its defaults (bytecode cache on: `PYTHONDONTWRITEBYTECODE` is
dropped; one uncounted run per demo writes the cache if missing). Baseline: a bare
`python -c pass` of the same interpreter, same run. The load average is in the notes: on
a busy machine every figure grows with it. `--redis-url` is not used: `run` starts its own.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import scenario
from benchmarks.harness.report import ROOT, Row, ratio
from benchmarks.harness.stats import spread

TARGET_S = 1.5
DEMOS = ("omni", "seed")
PROMPT = "hi"
LONG_PROMPT = " ".join(["a long prompt keeps the request streaming"] * 20)
OUTPUT = re.compile(rb"^\[\s*([0-9.]+) ms\] stage ")
DEADLINE_S = 60.0


@dataclass(frozen=True)
class Sizes:
    repeats: int


FULL = Sizes(repeats=7)
QUICK = Sizes(repeats=3)


@dataclass
class Run:
    """Seconds since launch of each moment of one `omni-runtime run`."""

    header_s: float = float("nan")
    submit_s: float = float("nan")
    first_s: float = float("nan")
    last_s: float = float("nan")
    gone_s: float = float("nan")
    code: int | None = None
    stages: list[str] = field(default_factory=list)


def command() -> list[str]:
    """The installed `omni-runtime` next to this interpreter, else `python -m` of the same."""
    script = Path(sys.executable).with_name("omni-runtime")
    return [str(script)] if script.exists() else [sys.executable, "-m", "omni_runtime.cli"]


def env() -> dict[str, str]:
    """This checkout importable first; no configured Redis (`run` starts its own)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    e.pop("PYTHONDONTWRITEBYTECODE", None)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    return e


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (from /proc: ppid links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: set[int], t0: float) -> float:
    """Seconds since `t0` once none of `pids` runs; RuntimeError past the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    delay = 0.0005
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(p for p in pids if alive(p))} did not exit")
        time.sleep(delay)
        delay = min(delay * 2, 0.005)
    return time.perf_counter() - t0


def once(demo: str, prompt: str, interrupt: bool) -> Run:
    """One `omni-runtime run`; with `interrupt`, SIGINT to its group after the first output."""
    cmd = [*command(), "run", "--pipeline", str(ROOT / "workers" / f"{demo}.yaml"), prompt]
    r = Run()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    pids: set[int] = set()
    try:
        for line in iter(proc.stdout.readline, b""):
            now = time.perf_counter() - t0
            if line.startswith(b"pipeline ") and r.header_s != r.header_s:
                r.header_s = now
            elif (m := OUTPUT.match(line)) is not None:
                if r.first_s != r.first_s:
                    r.first_s, r.submit_s = now, now - float(m.group(1)) / 1000
                    pids = descendants(proc.pid) | {proc.pid}
                    if interrupt:
                        os.killpg(proc.pid, signal.SIGINT)
                r.last_s = now
                r.stages.append(line.split(b"stage ", 1)[1].split(b":", 1)[0].decode())
        code = r.code = proc.wait(DEADLINE_S)
        r.gone_s = wait_gone(pids, t0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code not in ((130, 0) if interrupt else (0,)) or r.first_s != r.first_s:
        raise RuntimeError(f"{' '.join(cmd)}: exit code {code}, outputs from {r.stages}")
    if not interrupt and set(r.stages) != {"0", "2"}:
        raise RuntimeError(f"{demo}: expected outputs of stages 0 and 2, got {r.stages}")
    return r


def bare_interpreter_s() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env(), check=True)
    return time.perf_counter() - t0


def ms_of(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} ms"


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} {five:.1f} {fifteen:.1f} (1, 5, 15 min)"


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    base = statistics.median(bare_interpreter_s() for _ in range(sizes.repeats))
    rows = []
    for demo in DEMOS:
        once(demo, PROMPT, interrupt=False)  # warm-up: bytecode and file caches
        before = load()
        runs = [once(demo, PROMPT, interrupt=False) for _ in range(sizes.repeats)]
        # Ctrl-C mid-request: the omni demo streams the long prompt for seconds
        stops = [once(demo, LONG_PROMPT, interrupt=True) for _ in range(sizes.repeats)]
        phases = (
            f"phases (median): launch -> `pipeline` line {ms_of([r.header_s for r in runs])} "
            f"(interpreter, imports, stage code, Redis), -> submit "
            f"{ms_of([r.submit_s for r in runs])} (forks, every stage ready), -> first output "
            f"{ms_of([r.first_s for r in runs])}; {before}, after: {load()}"
        )
        measured: list[tuple[str, str, list[float], list[str]]] = [
            ("start-up", "launch -> first output", [r.first_s for r in runs], [phases]),
            ("shutdown", "last output -> all exited", [r.gone_s - r.last_s for r in runs], []),
            ("Ctrl-C", "SIGINT -> all exited", [r.gone_s - r.first_s for r in stops],
             [f"{sum(r.code == 130 for r in stops)} of {len(stops)} interrupted mid-request"]),
        ]  # fmt: skip
        for what, metric, values, notes in measured:
            value, lo, hi = spread(values)
            rows.append(Row(
                "startup", f"{demo}: {what}", metric, "s", value, lo, hi,
                baseline="python -c pass", baseline_value=base, ratio=ratio(value, base),
                ratio_of="time", target=f"<= {TARGET_S:g} s", met=value <= TARGET_S,
                notes=[f"{len(values)} runs of `omni-runtime run --pipeline workers/{demo}.yaml`"
                       f", each with its own redis-server", *notes],
            ))  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("startup", __doc__, run, FULL, QUICK))
