"""An embedded `serve` starts again a process of its deployment that died, and the
requests that process had in flight finish whole, as from any dead replica; one that
keeps dying stops `serve`, with its last log lines."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.e2e.serving import free_port
from tests.e2e.test_cli import OMNI, ROOT, cli_env, describe
from tests.e2e.test_lifecycle_signals import Launched, launched, serve_ready
from tests.e2e.test_run_lifecycle import START_DEADLINE_S
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.redis_server]

PROMPT = " ".join(f"w{i}" for i in range(150))  # ~3 s of thinker tokens at 20 ms each
REPLACED_DEADLINE_S = 30.0
"""From the kill to a new process of the stage beating (measured: ~2 s)."""
POISON_DEADLINE_S = 90.0
"""Three deaths, each taken over once its heartbeat expired (measured: ~20 s in all)."""


def redis_url_of(serve: Launched) -> str:
    found = re.search(r"on redis-server on port (\d+)", serve.output())
    assert found, serve.output()
    return f"redis://127.0.0.1:{found.group(1)}/0"


def stage_pids(redis_url: str, stage: int) -> set[int]:
    """The pids of stage `stage`'s workers, as `omni-runtime status` shows them. Its exit
    code 1 (some stage has no live worker: between a kill and the new process's first
    beat) still comes with the snapshot."""
    shown = subprocess.run(
        [sys.executable, "-m", "omni_runtime.cli", "status", "--once", "--json"],
        cwd=ROOT,
        env=cli_env(OMNI_REDIS_URL=redis_url),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shown.returncode in (0, 1), describe(shown)
    processes = json.loads(shown.stdout)["processes"]
    return {p["pid"] for p in processes if p["kind"] == "worker" and p["stage"] == stage}


def chat(port: int, on_first_text: Callable[[], None] | None = None) -> tuple[str, bytes]:
    """A streamed chat answer's text and audio; `on_first_text()` runs once text came."""
    body = {
        "model": "omni",
        "stream": True,
        "messages": [{"role": "user", "content": PROMPT}],
        "modalities": ["text", "audio"],
        "audio": {"format": "pcm16", "voice": "alloy"},
    }
    text: list[str] = []
    audio: list[bytes] = []
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            delta = event["choices"][0]["delta"]
            if delta.get("content"):
                if not text and on_first_text is not None:
                    on_first_text()
                text.append(delta["content"])
            if (delta.get("audio") or {}).get("data"):
                audio.append(base64.b64decode(delta["audio"]["data"]))
    return "".join(text), b"".join(audio)


def test_a_killed_worker_is_started_again_and_its_request_finishes_whole() -> None:
    port = free_port()
    with launched("serve", "--pipeline", OMNI, "--port", str(port)) as serve:
        wait_until(lambda: serve_ready(serve, port), START_DEADLINE_S)
        redis_url = redis_url_of(serve)
        (thinker,) = stage_pids(redis_url, 0)

        text, audio = chat(port, lambda: os.kill(thinker, signal.SIGKILL))

        assert "stage0-thinker-0 exited with code -9; starting it again" in serve.output()
        wait_until(lambda: len(stage_pids(redis_url, 0) - {thinker}) == 1, REPLACED_DEADLINE_S)
        # the answer is the one a request nothing happened to gets: nothing lost, nothing twice
        assert (text, audio) == chat(port), serve.output()
        assert text.split() == PROMPT.split()
        assert serve.proc.poll() is None
        logs = re.search(r"its processes log to (\S+)", serve.output())
        assert logs, serve.output()
        both_lives = (Path(logs.group(1)) / "stage0-thinker-0.log").read_text()
        assert both_lives.count("of stage 0 (thinker) ready") == 2, both_lives


def test_a_process_that_keeps_dying_stops_serve_with_its_log_lines() -> None:
    port = free_port()
    with launched("serve", "--pipeline", OMNI, "--port", str(port)) as serve:
        wait_until(lambda: serve_ready(serve, port), START_DEADLINE_S)
        redis_url = redis_url_of(serve)
        killed: set[int] = set()
        for _ in range(4):  # RESTART_LIMIT is 3 in a minute
            wait_until(lambda: bool(stage_pids(redis_url, 1) - killed), REPLACED_DEADLINE_S)
            (talker,) = stage_pids(redis_url, 1) - killed
            os.kill(talker, signal.SIGKILL)
            killed.add(talker)
        wait_until(lambda: serve.proc.poll() is not None, REPLACED_DEADLINE_S)
        assert serve.proc.returncode == 1, serve.output()
        assert "stage1-talker-0 exited with code -9 and died 4 times" in serve.output()
        assert "starting it again (3 of 3 in 60 s)" in serve.output()


def test_a_request_that_kills_its_worker_each_time_fails_alone_and_serve_goes_on() -> None:
    """Each replica that takes it over dies too, until it has been delivered
    `OMNI_MAX_DELIVERIES` (3) times: then it is dead-lettered and fails with a clear
    error; the worker started again serves the next request."""
    port = free_port()
    dies = str(ROOT / "tests" / "pipelines" / "dies.yaml")
    with launched("serve", "--pipeline", dies, "--port", str(port)) as serve:
        wait_until(lambda: serve_ready(serve, port), START_DEADLINE_S)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"

        def chat_with(prompt: str) -> httpx.Response:
            body = {"model": "dies", "messages": [{"role": "user", "content": prompt}]}
            return httpx.post(url, json=body, timeout=POISON_DEADLINE_S)

        poisoned = chat_with("please die")
        assert poisoned.status_code == 502, poisoned.text
        assert "delivered 3 times without finishing" in poisoned.json()["error"]["message"]
        assert serve.output().count("stage0-fragile-0 exited with code 3; starting it") == 3
        wait_until(lambda: serve_ready(serve, port), REPLACED_DEADLINE_S)
        fine = chat_with("live on")
        assert fine.status_code == 200, fine.text
        assert "live on" in fine.json()["choices"][0]["message"]["content"]
        assert serve.proc.poll() is None
