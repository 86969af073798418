"""Shared fixtures: a real redis-server per session (flushed per test) and in-process fakeredis.

Real Redis: `OMNI_TEST_REDIS_URL` if set, else a `redis-server` started here on a
free loopback port. When neither is available the tests that need it are
skipped — except under `CI=true`, where a missing server is a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

REDIS_URL_ENV = "OMNI_TEST_REDIS_URL"
SERVER_START_TIMEOUT_S = 10.0


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"true", "1"}


def _unavailable(reason: str) -> NoReturn:
    """Fail under CI=true (a required service is missing), skip otherwise."""
    if _under_ci():
        pytest.fail(f"{reason}; a redis-server is required under CI=true", pytrace=False)
    pytest.skip(reason)


def _ping(url: str, timeout_s: float = 0.5) -> bool:
    client = redis.Redis.from_url(
        url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start_redis_server(binary: str, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start redis-server on a free port; retry on another port if it dies (port race)."""
    for _ in range(3):
        port = _free_loopback_port()
        url = f"redis://127.0.0.1:{port}/0"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [
                    *(binary, "--port", str(port), "--bind", "127.0.0.1"),
                    *("--save", "", "--appendonly", "no", "--daemonize", "no"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if _ping(url):
                return proc, url
            time.sleep(0.02)
        _stop(proc)
    raise RuntimeError(f"redis-server did not answer PING within {SERVER_START_TIMEOUT_S} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real Redis for the whole session (given by env, or started here)."""
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        if not _ping(url, timeout_s=2.0):
            _unavailable(f"{REDIS_URL_ENV}={url} is not reachable")
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        _unavailable(f"no redis-server on PATH and {REDIS_URL_ENV} is not set")
    log_path = tmp_path_factory.mktemp("redis-server") / "redis-server.log"
    try:
        proc, url = _start_redis_server(binary, log_path)
    except RuntimeError as e:
        log_tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        _unavailable(f"{e}; log:\n{log_tail}")
    try:
        yield url
    finally:
        _stop(proc)


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    """The real Redis, empty at the start of the test."""
    client = redis.Redis.from_url(redis_server_url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server_url


@pytest.fixture
def fake_server() -> fakeredis.FakeServer:
    """A fresh in-process fake Redis; share it between clients with `server=`."""
    return fakeredis.FakeServer()


@pytest.fixture
def fake_redis(fake_server: fakeredis.FakeServer) -> Iterator[fakeredis.FakeRedis]:
    """A sync fakeredis client on `fake_server`, closed after the test."""
    client = fakeredis.FakeRedis(server=fake_server)
    try:
        yield client
    finally:
        client.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tag every test that needs a real redis-server (`-m "not redis_server"` skips them)."""
    for item in items:
        if "redis_server_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis_server)
