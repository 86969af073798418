"""`run` and a deployment over their life: Ctrl-C, logs of a failed run, modes, `bench` exits."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_cli import OMNI, OUTPUT_LINE, ROOT, SEED, cli, cli_env, describe
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

LONG_PROMPT = " ".join(["word"] * 400)  # ~8 s of thinker tokens at 20 ms each
CTRL_C_BOUND_S = 5.0
"""Generous for two loaded cores; unloaded, `run` stops in well under 1.5 s."""
START_DEADLINE_S = 60.0


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid`, by pid, with its command name."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            with contextlib.suppress(OSError):
                found[child] = Path(f"/proc/{child}/comm").read_text().strip()
            todo.append(child)
    return found


def running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


STOP_SIGNALS_MASK = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))


def threads_taking_stop_signals(pid: int) -> int:
    """How many threads of `pid` do not block SIGINT and SIGTERM (`SigBlk` in /proc); a
    thread in `sigwait` for them shows them unblocked while it waits."""
    taking = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("SigBlk:"):
                    taking += int(line.split()[1], 16) & STOP_SIGNALS_MASK != STOP_SIGNALS_MASK
    return taking


def workers_taking_stop_signals(started: dict[int, str]) -> int:
    """Processes with exactly one thread taking SIGINT and SIGTERM (in its sigwait)."""
    return sum(threads_taking_stop_signals(pid) == 1 for pid in started)


def test_ctrl_c_stops_run_and_everything_it_started_at_once() -> None:
    """The terminal's SIGINT reaches the whole process group: the private redis-server must
    outlive the processes using it (its own session), and nobody waits on a lost Redis."""
    with subprocess.Popen(
        [sys.executable, "-m", "omni_runtime.cli", "run", "--pipeline", OMNI, LONG_PROMPT],
        cwd=ROOT,
        env=cli_env(),  # no Redis URL: `run` starts its own redis-server
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, like a shell's job
    ) as run:
        assert run.stdout is not None and run.stderr is not None
        lines: list[str] = []
        stdout = run.stdout
        reader = threading.Thread(target=lambda: lines.extend(stdout), daemon=True)
        reader.start()
        try:
            wait_until(
                lambda: run.poll() is not None or any(OUTPUT_LINE.match(x) for x in lines),
                START_DEADLINE_S,
            )
            assert run.poll() is None, f"run ended early:\n{''.join(lines)}{run.stderr.read()}"
            started = descendants(run.pid)
            assert "redis-server" in started.values(), started
            assert len(started) >= 5, started  # redis-server, orchestrator, a worker per stage
            # A worker's stop signals are taken by one thread of its several (`worker/
            # signals.py`): left to the kernel, one that landed on a thread blocked in a read
            # waited for the main thread's idle wait (1 s). The orchestrator's asyncio loop
            # takes its own.
            wait_until(lambda: workers_taking_stop_signals(started) == 3, 10)
            sent_at = time.monotonic()
            os.killpg(run.pid, signal.SIGINT)
            code = run.wait(timeout=30)
            elapsed_s = time.monotonic() - sent_at
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
        stderr = run.stderr.read()
        reader.join(timeout=10)  # at EOF: the process has exited
    assert code == 130, stderr
    assert elapsed_s < CTRL_C_BOUND_S, f"stopped after {elapsed_s:.2f} s\n{stderr}"
    assert "Traceback" not in stderr
    assert "did not stop in time" not in stderr
    assert "logs kept" not in stderr  # an interrupted run did not fail
    assert "unsent" not in stderr  # its client ended the request: its abort was not dropped
    left = [f"{pid} {name}" for pid, name in started.items() if running(pid)]
    assert left == [], left


BROKEN_STAGE = """
import os

if "OMNI_REDIS_URL" in os.environ:  # imports for `run`'s own checks; fails in the worker
    raise RuntimeError("this stage cannot start in a worker")


def upper(data):
    return [str(w).upper() for w in data]
"""

BROKEN_PIPELINE = """
name: broken
final_stage_ids: [1]
stages:
  - {id: 0, name: split_words, entry: workers.seed:split_words}
  - {id: 1, name: upper, entry: brokenstage:upper}
"""


def test_a_failed_run_keeps_the_logs_and_says_where(redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "brokenstage.py").write_text(BROKEN_STAGE)
    (tmp_path / "broken.yaml").write_text(BROKEN_PIPELINE)
    logs_root = tmp_path / "tmp"
    logs_root.mkdir()
    env = cli_env(TMPDIR=str(logs_root))
    proc = cli(
        "run", "--pipeline", str(tmp_path / "broken.yaml"), "--redis-url", redis_url, "hi", env=env
    )
    assert proc.returncode == 2, describe(proc)
    assert "stage1-upper-0 exited with code 1" in proc.stderr, describe(proc)
    found = re.search(r"^logs kept in (\S+)$", proc.stderr, re.MULTILINE)
    assert found is not None, describe(proc)
    log_dir = Path(found.group(1))
    try:
        assert log_dir.parent == logs_root
        worker_log = (log_dir / "stage1-upper-0.log").read_text()
        assert "Traceback" in worker_log
        assert "RuntimeError: this stage cannot start in a worker" in worker_log
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    ok = cli("run", "--pipeline", SEED, "--redis-url", redis_url, "hi there", env=env)
    assert ok.returncode == 0, describe(ok)
    assert "logs kept" not in ok.stderr
    assert list(logs_root.iterdir()) == []  # a run that went well leaves nothing behind


class Deployment:
    """An orchestrator and a worker per stage as OS processes, each mode given on its own."""

    def __init__(self, redis_url: str, tmp_path: Path, pipeline: Path | str) -> None:
        self.tmp_path = tmp_path
        self.pipeline = str(pipeline)
        self.env = cli_env(OMNI_REDIS_URL=redis_url, OMNI_NAMESPACE=f"d{uuid.uuid4().hex[:8]}")
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> None:
        with (self.tmp_path / f"{name}.log").open("wb") as log:
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "omni_runtime.cli", *args, "--pipeline", self.pipeline],
                    cwd=ROOT,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def deployment(
    redis_url: str, tmp_path: Path, pipeline: Path | str, orchestrator_mode: str, stages: int
) -> Iterator[Deployment]:
    d = Deployment(redis_url, tmp_path, pipeline)
    try:
        d.start("orchestrator", "orchestrator", "--mode", orchestrator_mode)
        for sid in range(stages):
            d.start(f"stage{sid}", "worker", "--stage", str(sid))
        yield d
    finally:
        d.stop()


def heartbeat_of(redis_url: str, key: str) -> bool:
    import redis

    with redis.Redis.from_url(redis_url) as client:
        return bool(client.exists(key))


def test_a_worker_in_another_mode_than_the_orchestrator_refuses_to_start(
    redis_url: str, tmp_path: Path
) -> None:
    """It used to log "ready", then fail every request it took."""
    d = Deployment(redis_url, tmp_path, SEED)
    namespace = d.env["OMNI_NAMESPACE"]
    try:
        d.start("orchestrator", "orchestrator", "--mode", "streaming")
        beat = f"{namespace}:hb:orchestrator"
        wait_until(lambda: heartbeat_of(redis_url, beat), START_DEADLINE_S)
        worker = cli("worker", "--pipeline", SEED, "--stage", "1", env=d.env)
    finally:
        d.stop()
    assert worker.returncode == 2, describe(worker)
    line = worker.stderr.strip()
    assert line.startswith("omni-runtime: error: the orchestrator of namespace "), line
    assert "runs streaming mode, this process sequential" in line and "--mode" in line
    assert "ready" not in worker.stderr and "\n" not in line


def test_an_orchestrator_in_another_mode_than_the_workers_refuses_to_start(
    redis_url: str, tmp_path: Path
) -> None:
    d = Deployment(redis_url, tmp_path, SEED)
    namespace = d.env["OMNI_NAMESPACE"]
    try:
        d.start("worker", "worker", "--stage", "2", "--mode", "streaming")
        pattern = f"{namespace}:hb:stage:2:*"

        def beating() -> bool:
            import redis

            with redis.Redis.from_url(redis_url) as client:
                return any(True for _ in client.scan_iter(pattern))

        wait_until(beating, START_DEADLINE_S)
        orchestrator = cli("orchestrator", "--pipeline", SEED, env=d.env)
    finally:
        d.stop()
    assert orchestrator.returncode == 2, describe(orchestrator)
    line = orchestrator.stderr.strip()
    assert "a worker of stage 2" in line and "runs streaming mode, this process sequential" in line
    assert "Traceback" not in orchestrator.stderr


def test_bench_exits_1_when_requests_failed(redis_url: str, tmp_path: Path) -> None:
    path = tmp_path / "failing.yaml"
    path.write_text((ROOT / SEED).read_text().replace("fail_word: null", "fail_word: hi"))
    with deployment(redis_url, tmp_path, path, "sequential", stages=3) as d:
        bench = ("bench", "--pipeline", str(path), "-n", "6", "-c", "3")
        good = cli(*bench, "--prompt", "hello there", env=d.env)
        bad = cli(*bench, "--prompt", "hi there", env=d.env)
    assert good.returncode == 0, describe(good)
    assert good.stdout.startswith("6 requests, concurrency 3, 0 errors")
    # a slow pipeline's rate keeps its decimals (2.65, not 3); a fast one's is whole
    assert re.search(r"^throughput  (\d{1,2}\.\d\d|[\d,]{3,}) requests/s$", good.stdout, re.M)
    assert bad.returncode == 1, describe(bad)
    assert bad.stdout.startswith("6 requests, concurrency 3, 6 errors"), describe(bad)
    assert "first error stage 1 failed: ValueError" in bad.stdout, describe(bad)  # why
    assert "Traceback" not in bad.stderr


def test_bench_reports_first_text_first_audio_and_how_the_audio_plays(
    redis_url: str, tmp_path: Path
) -> None:
    """A pipeline whose file says which stage is text and which is audio (`outputs`): what a
    voice pipeline's users wait for and hear, besides the first output of any stage."""
    with deployment(redis_url, tmp_path, ROOT / OMNI, "streaming", stages=3) as d:
        bench = cli("bench", "--pipeline", OMNI, "-n", "4", "-c", "2", "--prompt", "a b c d e",
                    env=d.env)  # fmt: skip
    assert bench.returncode == 0, describe(bench)

    def p50(name: str) -> float:
        found = re.search(rf"^{name} +p50 ([\d.]+) ms", bench.stdout, re.M)
        assert found, bench.stdout
        return float(found.group(1))

    assert 0 < p50("first text") < p50("first audio"), bench.stdout  # words, then their sound
    assert re.search(r"^continuity  \d+\.\d% of 4 with no gap over 100 ms", bench.stdout, re.M)
