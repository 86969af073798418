"""Processes forked from a preloaded parent: exit codes, output, signals, like spawned ones.

Each case runs in a fresh interpreter (a single-threaded parent, as `run` forks from),
never in the test process itself.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, socket, sys
from omni_runtime.cli import CHILDREN, main
from omni_runtime.local.forked import can_fork, fork_main, preload

assert can_fork()
preload(CHILDREN)
log = open(sys.argv[1], "wb")
version = fork_main(main, ["--version"], dict(os.environ), log)
bad = fork_main(main, ["no-such-command"], dict(os.environ), log)
silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
env = {**os.environ, "OMNI_REDIS_URL": f"redis://127.0.0.1:{silent.getsockname()[1]}/0"}
waiting = fork_main(main, ["worker", "--pipeline", "workers/seed.yaml", "--stage", "0"], env, log)
print(version.wait(60), bad.wait(60), waiting.poll())
waiting.kill()
print(waiting.wait(60))
"""


def test_forked_children_exit_print_and_die_like_processes(tmp_path: Path) -> None:
    log = tmp_path / "children.log"
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.splitlines()
    assert first == "0 2 None"  # --version: 0; a usage error: 2; a worker still running
    assert second == "-9"  # killed: -SIGKILL, as subprocess reports it
    text = log.read_text()
    assert "omni-runtime 0.1.0" in text
    assert "invalid choice: 'no-such-command'" in text
