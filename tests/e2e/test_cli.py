"""The command line as a user runs it: real processes, real exit codes, real files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
import wave
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
SEED = "workers/seed.yaml"
OMNI = "workers/omni.yaml"
PROCESS_TIMEOUT_S = 90
OUTPUT_LINE = re.compile(r"^\[\s*[\d.]+ ms\] stage (\d+): (.*?)(  \(finished\))?$")


def cli_env(**extra: str) -> dict[str, str]:
    """This environment without any `OMNI_*` setting (OMNI_REDIS_URL above all), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    env.update(extra)
    return env


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omni_runtime.cli", *args],
        cwd=ROOT,
        env=cli_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        check=False,
    )


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def outputs(stdout: str) -> list[tuple[int, str, bool]]:
    """The `stage N: data  (finished)` lines of `run` / `submit`, in order."""
    found = []
    for line in stdout.splitlines():
        m = OUTPUT_LINE.match(line)
        if m:
            found.append((int(m.group(1)), m.group(2), m.group(3) is not None))
    return found


SEED_OUTPUTS = [
    (0, "'hi'", False),
    (0, "'there'", False),
    (2, "'wav:HI'", False),
    (2, "'wav:THERE'", True),
]


def test_run_seed_pipeline(redis_url: str) -> None:
    proc = cli("run", "--pipeline", SEED, "--redis-url", redis_url, "hi there")
    assert proc.returncode == 0, describe(proc)
    assert "pipeline 'seed' (sequential mode) on configured" in proc.stdout
    assert outputs(proc.stdout) == SEED_OUTPUTS, describe(proc)
    assert "Traceback" not in proc.stderr


def read_wav(path: Path) -> tuple[int, int, int, int]:
    with wave.open(str(path), "rb") as w:
        return w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()


def test_run_omni_pipeline_writes_the_same_wav_in_both_modes(
    redis_url: str, tmp_path: Path
) -> None:
    files = {}
    for mode in ("streaming", "sequential"):
        wav_path = tmp_path / mode / "out.wav"
        wav_path.parent.mkdir()
        proc = cli(
            *("run", "--pipeline", OMNI, "--mode", mode, "--redis-url", redis_url),
            *("--wav", str(wav_path), "Hello, world!"),
        )
        assert proc.returncode == 0, describe(proc)
        assert f"({mode} mode)" in proc.stdout
        outs = outputs(proc.stdout)
        assert [data for sid, data, _ in outs if sid == 0] == ["'Hello'", "','", "'world'", "'!'"]
        assert len([o for o in outs if o[0] == 2]) == 4, describe(proc)
        assert [finished for *_, finished in outs] == [False] * (len(outs) - 1) + [True]
        channels, width, rate, frames = read_wav(wav_path)
        assert (channels, width, rate) == (1, 2, 16000)
        assert frames > 0
        assert f"wrote {wav_path}: {frames} frames" in proc.stdout
        files[mode] = wav_path.read_bytes()
    assert files["streaming"] == files["sequential"]


def test_run_without_redis_uses_the_embedded_server(tmp_path: Path) -> None:
    # sys.executable is called by absolute path: a PATH without redis-server is enough.
    proc = cli("run", "--pipeline", SEED, "hi there", env=cli_env(PATH=str(tmp_path / "empty")))
    assert proc.returncode == 0, describe(proc)
    assert "embedded" in proc.stdout
    assert outputs(proc.stdout) == SEED_OUTPUTS, describe(proc)


def test_bad_pipeline_file_exits_2_naming_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        (ROOT / SEED).read_text().replace("name: upper_all", "name: upper_all\n    replicas: 0")
    )
    for command in ("run", "submit"):
        proc = cli(command, "--pipeline", str(path), "--redis-url", "redis://127.0.0.1:1", "hi")
        assert proc.returncode == 2, describe(proc)
        assert str(path) in proc.stderr
        assert "stages.1.replicas" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stdout == ""


def test_missing_pipeline_file_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    proc = cli("run", "--pipeline", str(path), "hi", env=cli_env(PATH=str(tmp_path)))
    assert proc.returncode == 2, describe(proc)
    assert str(path) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_redis_url_exits_2_naming_the_setting() -> None:
    proc = cli("run", "--pipeline", SEED, "--redis-url", "http://localhost:6379", "hi")
    assert proc.returncode == 2, describe(proc)
    assert "OMNI_REDIS_URL (--redis-url)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", [None, "orchestrator", "worker", "submit", "run", "bench"])
def test_help(command: str | None) -> None:
    proc = cli(*([command] if command else []), "--help")
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout.startswith("usage: omni-runtime")
    if command is not None:
        assert "--pipeline" in proc.stdout
        assert "--redis-url" in proc.stdout


def test_submit_with_nothing_running_times_out(redis_url: str) -> None:
    namespace = f"empty{uuid.uuid4().hex[:8]}"
    env = cli_env(OMNI_STARTUP_TIMEOUT_S="1", OMNI_REDIS_URL=redis_url)
    started = time.monotonic()
    proc = cli("submit", "--pipeline", SEED, "--namespace", namespace, "hi", env=env)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, describe(proc)
    assert "OMNI_STARTUP_TIMEOUT_S" in proc.stderr
    assert "orchestrator" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed >= 1.0
