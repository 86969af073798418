"""Every setting given to `run` or `serve` reaches every process they start, whichever way
it was given (a flag, a variable, the settings file), with the same precedence as in
`run` itself: flags over variables over the file.

`run`: each process logs the settings it runs with (at debug level, which `--log-level`
passed on to it turns on); a 0.1 s deadline fails the request ("deadline exceeded", the
orchestrator's doing), so `run` keeps the logs and says where. `serve`: each process
serves metrics on its own port from `--metrics-port`, and `--trace` records a request's
stamps in the private Redis from the orchestrator and a worker of every stage."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from omni_runtime.keys import Names
from omni_runtime.local.redis_server import free_port, free_ports
from omni_runtime.observe.tracing import read_redis_trace
from tests.e2e.test_cli import OMNI, cli, cli_env, describe
from tests.e2e.test_lifecycle_signals import launched, serve_ready
from tests.e2e.test_run_lifecycle import START_DEADLINE_S
from tests.every_setting import NON_DEFAULT, flag
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]

PROCESSES = ["orchestrator", "stage0-thinker-0", "stage1-talker-0", "stage2-code2wav-0"]
"""What `run` starts for workers/omni.yaml, in order: process i serves metrics on base + i."""
SETTINGS_LINE = re.compile(r" settings: (\{.*\})$", re.MULTILINE)
PROMPT = "hi there how are you today"


def settings_logged(log: str) -> dict[str, Any]:
    found = SETTINGS_LINE.findall(log)
    assert len(found) == 1, log[-3000:]
    parsed: dict[str, Any] = json.loads(found[0])
    return parsed


def test_every_setting_given_to_run_reaches_every_process_it_starts(tmp_path: Path) -> None:
    metrics_base = free_ports(len(PROCESSES))
    wanted = {k: v for k, v in NON_DEFAULT.items() if k != "redis_url"}  # `run` starts one
    wanted |= {"deadline_s": 0.1, "trace_file": str(tmp_path / "trace.txt")}
    wanted["metrics_port"] = metrics_base
    names = sorted(wanted)
    in_file = {n: wanted[n] for n in names[::2]}
    as_flags = {n: wanted[n] for n in names[1::2]}
    # Precedence: a variable beneath a flag, the file beneath a variable.
    as_flags["read_count"] = wanted["read_count"]
    env = cli_env(OMNI_READ_COUNT="7", OMNI_CHUNK_TTL_S=str(wanted["chunk_ttl_s"]))
    as_flags.pop("chunk_ttl_s", None)
    in_file["chunk_ttl_s"] = 5
    settings_file = tmp_path / "settings.yaml"
    settings_file.write_text(yaml.safe_dump(in_file))
    env["TMPDIR"] = str(tmp_path)  # where `run` keeps the logs of a failed run
    flags = [part for name, value in as_flags.items() for part in flag(name, value)]
    proc = cli(
        "run",
        "--pipeline",
        OMNI,
        "--log-level",
        "DEBUG",
        "--settings-file",
        str(settings_file),
        *flags,
        PROMPT,
        env=env,
    )
    assert proc.returncode == 1, describe(proc)
    assert re.search(r"stage \d ERROR: deadline exceeded", proc.stderr), describe(proc)
    kept = re.search(r"^logs kept in (\S+)$", proc.stderr, re.MULTILINE)
    assert kept is not None, describe(proc)
    log_dir = Path(kept.group(1))
    try:
        for i, name in enumerate(PROCESSES):
            got = settings_logged((log_dir / f"{name}.log").read_text())
            assert got.pop("redis_url").startswith("redis://127.0.0.1:"), name
            expected = {**wanted, "metrics_port": metrics_base + i}
            different = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
            assert different == {}, f"{name}: (got, given) {different}"
            assert set(got) == set(expected), name
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def private_redis_port(started: dict[int, str]) -> int:
    """From the server's title, `redis-server 127.0.0.1:PORT` (it rewrites its command line)."""
    (pid,) = [pid for pid, name in started.items() if name == "redis-server"]
    title = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    found = re.search(r"127\.0\.0\.1:(\d+)", title)
    assert found is not None, title
    return int(found.group(1))


def metrics_of(port: int) -> str:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert response.status_code == 200, response.text
    return response.text


def test_serve_passes_metrics_port_and_trace_to_every_process_it_starts() -> None:
    port, metrics_base = free_port(), free_ports(len(PROCESSES))
    args = ("--pipeline", OMNI, "--port", str(port), "--metrics-port", str(metrics_base))
    with launched("serve", *args, "--trace") as serve:
        wait_until(lambda: serve_ready(serve, port), START_DEADLINE_S)
        started = serve.all_started()
        roles = [
            re.findall(r'role="(\w+)"', metrics_of(metrics_base + i)) for i in range(len(PROCESSES))
        ]
        assert {r for found in roles for r in found} == {"orchestrator", "stage"}, roles
        assert set(roles[0]) == {"orchestrator"} and all(set(r) == {"stage"} for r in roles[1:])
        body = {"model": "omni", "messages": [{"role": "user", "content": "hi"}],
                "modalities": ["text", "audio"], "audio": {"format": "wav", "voice": "x"}}  # fmt: skip
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        request_id = response.headers["X-Omni-Request-Id"]
        r = redis.Redis(port=private_redis_port(started))
        try:
            wanted = {("request_read", None)} | {("input_read", k) for k in range(3)}

            def stamped() -> set[tuple[str, int | None]]:
                stamps = read_redis_trace(r, Names("omni"), request_id)
                return {(event, stage) for event, _rid, stage, _t in stamps}

            end = time.monotonic() + 30
            while not wanted <= stamped():  # stamps are written by each process's thread
                assert time.monotonic() < end, f"stamps: {sorted(stamped(), key=str)}"
                time.sleep(0.02)
        finally:
            r.close()
