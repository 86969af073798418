"""The command line's edges: errors are one line, never a traceback; input from anywhere."""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

import pytest

from tests.e2e.test_cli import OMNI, ROOT, SEED, SEED_OUTPUTS, cli, cli_env, describe, outputs

pytestmark = pytest.mark.timeout(120)


def test_version_is_printed() -> None:
    proc = cli("--version")
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout.startswith("omni-runtime ")


def test_verbose_flag_is_accepted_after_the_subcommand(redis_url: str) -> None:
    proc = cli("run", "--pipeline", SEED, "--redis-url", redis_url, "-v", "hi there")
    assert proc.returncode == 0, describe(proc)
    assert " DEBUG " in proc.stderr


def test_a_settings_error_names_the_variable_in_one_line() -> None:
    proc = cli("run", "--pipeline", SEED, "hi", env=cli_env(OMNI_DEADLINE_S="-1"))
    assert proc.returncode == 2, describe(proc)
    assert "OMNI_DEADLINE_S (--deadline-s)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_every_setting_is_a_flag_too(redis_url: str) -> None:
    proc = cli("run", "--pipeline", SEED, "--redis-url", redis_url, "--deadline-s", "-1", "hi")
    assert proc.returncode == 2, describe(proc)
    assert "OMNI_DEADLINE_S" in proc.stderr


def test_settings_come_from_a_file(redis_url: str, tmp_path: Path) -> None:
    settings = tmp_path / "omni.yaml"
    settings.write_text(f"redis_url: {redis_url}\nnamespace: fromfile\n")
    proc = cli("run", "--pipeline", SEED, "--settings-file", str(settings), "hi there")
    assert proc.returncode == 0, describe(proc)
    assert "on configured" in proc.stdout
    assert outputs(proc.stdout) == SEED_OUTPUTS


def test_wav_into_a_missing_directory_fails_before_the_run(tmp_path: Path) -> None:
    wav = tmp_path / "missing" / "out.wav"
    proc = cli("run", "--pipeline", OMNI, "--wav", str(wav), "Hello")
    assert proc.returncode == 2, describe(proc)
    assert "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "pipeline 'omni'" not in proc.stdout  # nothing was started


def test_a_big_prompt_comes_from_a_file_or_stdin(redis_url: str, tmp_path: Path) -> None:
    word = "x" * 200_000  # over the ~128 KiB an argument can carry
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(word)
    base = ("run", "--pipeline", SEED, "--redis-url", redis_url)
    by_file = cli(*base, "--prompt-file", str(prompt_file))
    assert by_file.returncode == 0, describe(by_file)
    by_stdin = subprocess.run(
        [sys.executable, "-m", "omni_runtime.cli", *base, "-"],
        cwd=ROOT,
        env=cli_env(),
        input=word,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert by_stdin.returncode == 0, describe(by_stdin)
    for proc in (by_file, by_stdin):
        assert [sid for sid, _data, _fin in outputs(proc.stdout)] == [0, 2]


def test_a_pipeline_that_hears_is_sent_a_wav_file(redis_url: str, tmp_path: Path) -> None:
    """`--prompt-file` (or stdin) names the recording; the stage gets it as an upload."""
    wav = tmp_path / "question.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(bytes(2 * 12_000))
    base = ("run", "--pipeline", str(ROOT / "tests" / "pipelines" / "transcribe.yaml"),
            "--redis-url", redis_url)  # fmt: skip
    by_file = cli(*base, "--prompt-file", str(wav))
    by_stdin = subprocess.run(
        [sys.executable, "-m", "omni_runtime.cli", *base, "--prompt-file", "-"],
        cwd=ROOT, env=cli_env(), input=wav.read_bytes(), capture_output=True, timeout=90,
        check=False,
    )  # fmt: skip
    assert by_stdin.returncode == 0, by_stdin.stderr
    assert by_file.returncode == 0, describe(by_file)
    for stdout in (by_file.stdout, by_stdin.stdout.decode()):
        assert outputs(stdout) == [(0, "'1.5000 s, 8000 Hz, 1 ch, language -'", True)]


def test_submit_and_bench_refuse_mode_the_deployment_owns_it() -> None:
    for command in ("submit", "bench"):
        proc = cli(command, "--pipeline", SEED, "--mode", "streaming", "hi")
        assert proc.returncode == 2, describe(proc)
        assert "unrecognized arguments: --mode" in proc.stderr


def test_an_options_typo_fails_at_start_naming_the_stage(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text((ROOT / OMNI).read_text().replace("token_delay_ms:", "token_delay:"))
    proc = cli("run", "--pipeline", str(path), "hi", env=cli_env(PATH=str(tmp_path)))
    assert proc.returncode == 2, describe(proc)
    assert "stage 0 (thinker)" in proc.stderr
    assert "token_delay" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_request_timeout_is_one_line(redis_url: str, tmp_path: Path) -> None:
    proc = cli(
        *("run", "--pipeline", OMNI, "--redis-url", redis_url),
        *("--request-timeout-s", "0.001", "Hello there, a slow thinker"),
        env=cli_env(TMPDIR=str(tmp_path)),  # where the failed run keeps its logs
    )
    assert proc.returncode == 2, describe(proc)
    assert "OMNI_REQUEST_TIMEOUT_S" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"logs kept in {tmp_path}" in proc.stderr, describe(proc)


def test_a_closed_pipe_is_not_a_traceback(redis_url: str) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "omni_runtime.cli", "run", "--pipeline", SEED, "hi there"],
        cwd=ROOT,
        env=cli_env(OMNI_REDIS_URL=redis_url),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as run:
        assert run.stdout is not None and run.stderr is not None
        run.stdout.close()  # like `| head -0`: the reader is gone before the first line
        stderr = run.stderr.read()
        assert run.wait(timeout=90) == 141, stderr
    assert "Traceback" not in stderr


def test_run_ends_with_a_summary(redis_url: str) -> None:
    proc = cli("run", "--pipeline", OMNI, "--redis-url", redis_url, "Hello, world!")
    assert proc.returncode == 0, describe(proc)
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("TTFT ") and "TTFP " in summary and "E2E " in summary
    assert "-" not in summary.replace("E2E", "")  # every figure measured
    assert "max_tokens" not in proc.stdout


def test_run_says_when_an_answer_stopped_at_max_tokens(redis_url: str) -> None:
    proc = cli(
        "run", "--pipeline", OMNI, "--redis-url", redis_url, "--param", "max_tokens=2", "a b c"
    )
    assert proc.returncode == 0, describe(proc)
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].endswith(" · stage 0 stopped at max_tokens"), lines[-1]
    assert [line for line in lines if "(stopped at max_tokens)" in line] == [
        next(line for line in lines if "stage 0: 'b'" in line)
    ]
