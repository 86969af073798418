"""The Ray Serve comparison's plumbing, without Ray: process trees, samples, verdicts, the hint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.harness.cpu import MACHINE, process_tree
from benchmarks.peers.load import Samples
from benchmarks.peers.report import OMNI_SYS, RAY_SYS, Cell, rows
from omni_runtime.client.playback import Playback

ROOT = Path(__file__).resolve().parents[2]


def test_process_tree_holds_every_descendant() -> None:
    code = "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'input()'], stdin=subprocess.PIPE); print(p.pid, flush=True); sys.stdin.readline()"
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as parent:  # fmt: skip
        try:
            assert parent.stdout is not None
            grandchild = int(parent.stdout.readline())  # its grandchild ends at EOF on stdin
            tree = process_tree(parent.pid)
            assert set(tree.values()) >= {parent.pid, grandchild}
            assert os.getpid() not in tree.values()
            assert all(name.endswith(f" {pid}") for name, pid in tree.items())
        finally:
            parent.kill()


def test_samples_survive_json() -> None:
    heard = Playback()
    heard.add(0.0, 0.1)
    heard.add(0.35, 0.1)  # a 250 ms gap
    s = Samples(ms={"ttft": [20.0], "ttfa": [40.0], "e2e": [1000.0]}, heard=[heard], wall_s=2.0)
    back = Samples.from_json(s.to_json())
    assert back.ms == s.ms and back.throughput == 0.5
    assert back.continuity == s.continuity and back.continuity.continuous_share == 0.0


def _cell(system: str, ttfa: float, cpu_s: float, gap_s: float = 0.0) -> Cell:
    heard = Playback()
    heard.add(0.0, 0.1)
    heard.add(0.1 + gap_s, 0.1)
    s = Samples(ms={"ttft": [20.0] * 4, "ttfa": [ttfa] * 4, "e2e": [1000.0] * 4},
                heard=[heard] * 4, wall_s=4.0)  # fmt: skip
    return Cell(system, "streaming", 32, s, {"p": cpu_s, MACHINE: cpu_s})


def test_verdicts_are_omni_over_ray_against_the_issue_targets() -> None:
    got = {r.metric: r for r in rows([_cell(OMNI_SYS, 40.0, 0.4), _cell(RAY_SYS, 100.0, 1.0)])}
    assert got["TTFA p50"].ratio == 0.4 and got["TTFA p50"].met is True
    assert got["E2E p50"].ratio == 1.0 and got["E2E p50"].met is False  # needs <= 0.8x
    assert got["CPU per request"].ratio == 0.4 and got["CPU per request"].met is True
    assert got["requests/s"].met is False  # the same rate: needs 2x
    gappy = {r.metric: r for r in rows([_cell(OMNI_SYS, 40.0, 0.4, gap_s=0.2),
                                        _cell(RAY_SYS, 100.0, 1.0)])}  # fmt: skip
    assert gappy["no gap > 100 ms"].met is False


def test_without_ray_it_says_how_to_install_it() -> None:
    block = "import sys, runpy; sys.modules['ray'] = None; sys.argv[0] = 'peers'; runpy.run_module('benchmarks.peers', run_name='__main__')"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "pip install -e '.[peers]'" in done.stderr
