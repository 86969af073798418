"""What a new user gets wrong, each answered in one line with exit code 2 before anything
starts, never a traceback: a prompt that is not UTF-8 or is empty, text for a pipeline that
takes speech or a file that is no WAV, a settings file that is no YAML mapping, serve
settings out of range; and a stop signal during start-up is obeyed."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.e2e.test_cli import OMNI, ROOT, SEED, cli, cli_env, describe
from tests.e2e.test_run_lifecycle import descendants, running
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

NOT_UTF8 = "café".encode("latin-1")


def cli_input(*args: str, stdin: bytes) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "omni_runtime.cli", *args],
        cwd=ROOT,
        env=cli_env(LC_ALL="C"),  # the locale that made Python decode stdin with surrogates
        input=stdin,
        capture_output=True,
        timeout=90,
        check=False,
    )
    return subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode()
    )


def assert_one_line(proc: subprocess.CompletedProcess[str], *said: str) -> None:
    assert proc.returncode == 2, describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("omni-runtime: error: "), describe(proc)
    for text in said:
        assert text in lines[0], describe(proc)
    assert "pipeline '" not in proc.stdout  # refused before anything started


def test_a_prompt_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "prompt.txt"
    path.write_bytes(NOT_UTF8)
    assert_one_line(cli("run", "--pipeline", SEED, "--prompt-file", str(path)), "not UTF-8")
    for args in (["-"], ["--prompt-file", "-"]):
        proc = cli_input("run", "--pipeline", SEED, *args, stdin=NOT_UTF8)
        assert_one_line(proc, "stdin", "not UTF-8", "0xe9")


def test_an_empty_prompt_is_an_error() -> None:
    for prompt in ("", "  \n"):
        assert_one_line(cli("run", "--pipeline", SEED, prompt), "the prompt is empty")
    proc = cli_input("submit", "--pipeline", SEED, "-", stdin=b"")
    assert_one_line(proc, "the prompt is empty")


def test_a_pipeline_that_hears_takes_a_recording_and_nothing_else(tmp_path: Path) -> None:
    hears = str(ROOT / "tests" / "pipelines" / "transcribe.yaml")
    assert_one_line(cli("run", "--pipeline", hears, "hello"), "takes speech", "--prompt-file")
    text = tmp_path / "prompt.txt"
    text.write_text("hello")
    proc = cli("run", "--pipeline", hears, "--prompt-file", str(text))
    assert_one_line(
        proc, f"--prompt-file {text}: not a WAV, MP3, FLAC or Ogg file (Format not recognised.)"
    )
    proc = cli_input("submit", "--pipeline", hears, "--prompt-file", "-", stdin=b"")
    assert_one_line(proc, "stdin: not a PCM WAV file (the file is empty)")


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"a: [\nb", "not valid YAML: expected ',' or ']'"),
        (b"- 1\n- 2\n", "not a mapping of settings"),
        (b"deadline_s: \xe9\n", "not UTF-8"),
        (b"deadline_s: -1\n", "OMNI_DEADLINE_S"),
    ],
)
def test_a_malformed_settings_file_is_one_line(tmp_path: Path, content: bytes, said: str) -> None:
    path = tmp_path / "settings.yaml"
    path.write_bytes(content)
    proc = cli("run", "--pipeline", SEED, "--settings-file", str(path), "hi")
    assert_one_line(proc, said)


def test_bad_serve_settings_are_one_line() -> None:
    secret = "short"
    proc = cli("serve", "--pipeline", OMNI, env=cli_env(OMNI_API_KEYS=f"long-enough-key,{secret}"))
    assert_one_line(proc, "OMNI_API_KEYS", "at least 8 characters")
    assert secret not in proc.stderr and "long-enough-key" not in proc.stderr
    proc = cli("serve", "--pipeline", OMNI, env=cli_env(OMNI_MAX_INFLIGHT="0"))
    assert_one_line(proc, "OMNI_MAX_INFLIGHT (--max-inflight)", "greater than 0")
    assert_one_line(cli("serve", "--pipeline", OMNI, "--port", "70000"), "OMNI_PORT (--port)")


FORK_WINDOW = """
import os, signal, sys
from pathlib import Path
from omni_runtime.cli import CHILDREN
from omni_runtime.local.launcher import ProcessGroup, child_env
from omni_runtime.pipeline import load_pipeline

signal.signal(signal.SIGTERM, signal.default_int_handler)  # as `run` and `serve` take it
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signal.SIGTERM))
group = ProcessGroup(Path("{pipeline}"), load_pipeline("{pipeline}"),
                     child_env("redis://127.0.0.1:1"), fork=CHILDREN)
try:
    group.start()
    print("started", len(group.procs))
except KeyboardInterrupt:
    print("stopped", len(group.procs))
finally:
    group.stop()
    print("exit codes", sorted(p.returncode is not None for _n, p, _f in group.procs))
"""


def test_a_stop_signal_during_a_fork_stops_the_start() -> None:
    """The signal arrives as `os.fork` returns in the parent: it used to be raised inside
    the fork's callbacks, printed as "Exception ignored" and lost, and `serve` served on."""
    script = textwrap.dedent(FORK_WINDOW).format(pipeline=SEED)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=cli_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, describe(proc)
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == ["stopped 1", "exit codes [True]"], describe(proc)  # the child was stopped


def test_serve_stopped_while_it_starts_its_processes_stops_them_all() -> None:
    serve = subprocess.Popen(
        [sys.executable, "-m", "omni_runtime.cli", "serve", "--pipeline", OMNI, "--port", "0"],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        # its redis-server starts first, then it forks the orchestrator and the workers
        wait_until(lambda: len(descendants(serve.pid)) >= 2 or serve.poll() is not None, 60)
        started = descendants(serve.pid)
        serve.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        output, _ = serve.communicate(timeout=30)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert serve.returncode == 0, output
    assert "Traceback" not in output and "Exception ignored" not in output, output
    wait_until(lambda: not any(running(pid) for pid in started), 10)
    assert time.monotonic() - stopped_at < 15
