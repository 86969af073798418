"""What a command-line process imports at start, how it waits for its children and Redis,
and the loopback ports it picks.

Import checks run in a fresh interpreter (the test process has imported everything).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import omni_runtime
from omni_runtime.cli import parse_args, parser_for
from omni_runtime.cli.commands import settings_of
from omni_runtime.cli.startup import document_fields
from omni_runtime.local.forked import ForkedProcess
from omni_runtime.local.launcher import redis_server_binary
from omni_runtime.local.redis_server import RedisServer, free_ports, ping
from omni_runtime.settings import Settings
from tests.services import unavailable

ROOT = Path(__file__).resolve().parents[2]


def fresh(code: str) -> str:
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_command_line_imports_no_redis_and_no_core_before_it_needs_them() -> None:
    out = fresh(
        "import sys, omni_runtime.cli\n"
        "print(sorted(m for m in ('redis', 'numpy', 'omni_runtime.chunks', 'omni_runtime.core.orchestrator') if m in sys.modules))"
    )
    assert out == "[]"


def test_package_names_still_import_on_first_use() -> None:
    out = fresh(
        "import sys, omni_runtime\n"
        "print('omni_runtime.chunks.adapter' in sys.modules)\n"
        "from omni_runtime import ChunkAdapter, Orchestrator, keys\n"
        "print(ChunkAdapter.__module__, Orchestrator.__module__, keys.__name__)\n"
        "print(sorted(set(omni_runtime.__all__) - set(dir(omni_runtime))))"
    )
    assert out.splitlines() == [
        "False",
        "omni_runtime.chunks.adapter omni_runtime.core.orchestrator omni_runtime.keys",
        "[]",
    ]
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = omni_runtime.no_such_name


def test_redis_is_imported_without_its_opentelemetry_sdk_which_stays_importable() -> None:
    import opentelemetry.sdk.metrics  # noqa: F401  (the [test] extra installs the SDK)

    out = fresh(
        "import sys\n"
        "from omni_runtime.cli.startup import import_redis\n"
        "import_redis()\n"
        "print('redis.asyncio' in sys.modules, 'opentelemetry.sdk.metrics' in sys.modules)\n"
        "import opentelemetry.sdk.metrics\n"
        "print(opentelemetry.sdk.metrics.MeterProvider.__name__)"
    )
    assert out.splitlines() == ["True False", "MeterProvider"]


def test_settings_flags_get_their_docstrings_as_help() -> None:
    document_fields(Settings)
    fields = Settings.model_fields
    assert fields["redis_url"].description is not None
    assert fields["redis_url"].description.startswith("`redis://` or `rediss://`")
    assert fields["deadline_s"].description == (
        "Orchestrator side: a request still running after this long ends with an error."
    )
    assert fields["chunk_ttl_s"].description is None  # no docstring: no help text made up


def test_waiting_for_a_forked_child_wakes_at_its_exit_and_times_out_while_it_runs() -> None:
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exit with a code of its own once told to
        os.read(go_r, 1)
        os._exit(7)
    os.close(go_r)
    child = ForkedProcess(pid)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.01)
    assert child.poll() is None
    os.write(go_w, b"x")
    os.close(go_w)
    assert child.wait(60) == 7
    assert child.wait(0) == 7  # reaped once, answered again


def test_a_launched_redis_server_is_awaited_then_shut_down_at_once(tmp_path: Path) -> None:
    if redis_server_binary() is None:
        unavailable("no redis-server on PATH", "a redis-server")
    server = RedisServer(log_path=tmp_path / "redis.log").launch()
    try:
        assert server.proc is not None
        assert server.wait_ready() is server
        assert ping(server.url)
        proc = server.proc
    finally:
        server.stop(now=True)
    assert proc.poll() is not None
    assert not ping(server.url)
    assert "User requested shutdown" in server.log_tail()  # SHUTDOWN, not a SIGTERM


def test_a_parser_built_once_parses_each_command_line_and_environment_afresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["worker", "--pipeline", "workers/seed.yaml", "--stage", "1"]
    first = parse_args([*argv, "--deadline-s", "7"])
    assert parser_for("worker") is parser_for("worker")
    monkeypatch.setenv("OMNI_DEADLINE_S", "9")
    monkeypatch.setenv("OMNI_NAMESPACE", "elsewhere")
    second = parse_args(argv)  # same parser: nothing of the first parse carries over
    assert (first.stage, second.stage) == (1, 1)
    assert settings_of(first).deadline_s == 7.0  # a flag wins over the environment
    assert settings_of(second).deadline_s == 9.0  # the environment of now, not of the build
    assert settings_of(second).namespace == "elsewhere"


def test_free_ports_are_consecutive_bindable_and_below_the_ephemeral_range() -> None:
    """An ephemeral port may go to any process's next outgoing connection before it is bound
    (a worker once could not serve its metrics on one)."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        base = free_ports(4)
        assert base >= 10_000 and base + 4 <= ephemeral
        with contextlib.ExitStack() as bound:
            for port in range(base, base + 4):
                bound.enter_context(socket.create_server(("127.0.0.1", port)))
