"""A sampling profile of one running process, by py-spy, kept as the benchmark's artifact.

py-spy attaches from outside (no runtime code changes, no restart) and samples the
interpreter's stacks: `record` writes a flame graph (SVG, open it in a browser) or
collapsed stacks ("folded": one `frame;frame;... count` line per stack, the input of
every flame-graph tool), frames by function (`--function`), not by line. Both come from real recordings: the SVG from one span of load,
the folded stacks from the next, from which `top_self` reads where the time goes.

py-spy is optional (`pip install -e '.[bench]'`); attaching needs ptrace rights (root,
or CAP_SYS_PTRACE in a container). Without either, `Profiler.available` says why and
the benchmark notes it instead of a profile.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

RATE_HZ = 250
"""Samples per second: enough for a flat profile in a few seconds of load, little overhead."""
IDLE_FRAMES = ("select (selectors.py", "epoll")
"""A stack whose innermost frame is one of these is the event loop waiting, not working."""


class Profiler:
    """`start(pid, out)` before a span of load, `stop()` after it; one recording at a time."""

    def __init__(self) -> None:
        self.exe = shutil.which("py-spy")
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    @property
    def available(self) -> str | None:
        """None when it can profile; else why not."""
        return None if self.exe else "py-spy not installed (pip install -e '.[bench]')"

    def start(self, pid: int, out: Path, fmt: str) -> None:
        """Sample `pid` into `out` as `fmt` ("flamegraph" or "raw") until `stop`."""
        assert self.exe is not None and self._proc is None
        self._log = out.with_suffix(out.suffix + ".log")
        cmd = [self.exe, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--format", fmt,
               "--output", str(out), "--nonblocking", "--function"]  # fmt: skip
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, timeout_s: float = 30.0) -> str | None:
        """Stop sampling and let py-spy write its file; None, or what went wrong."""
        proc, self._proc = self._proc, None
        if proc is None:
            return "not started"
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled, then exits
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return "py-spy did not exit"
        if code != 0:
            tail = (
                self._log.read_text(errors="replace").strip().splitlines()[-1:] if self._log else []
            )
            return f"py-spy exited {code}: {' '.join(tail) or 'no output'}"
        return None


def top_self(folded: Path, n: int = 12) -> tuple[int, list[tuple[str, float]]]:
    """(busy samples, the `n` frames with the most self time as % of busy samples): the
    loop's waiting (`IDLE_FRAMES`) is left out, so the shares are of the work done. py-spy
    counts a thread busy unless it sleeps, so on a saturated machine a sample may also be
    time spent waiting for a CPU: read shares, not absolute times."""
    own: Counter[str] = Counter()
    busy = 0
    for line in folded.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        if any(idle in leaf for idle in IDLE_FRAMES):
            continue
        busy += int(count)
        own[leaf] += int(count)
    return busy, [(frame, 100.0 * c / busy) for frame, c in own.most_common(n)] if busy else []
