"""The scenarios' Redis: the one given, or a private redis-server from `omni_runtime.local.launcher`.

Never the launcher's embedded fakeredis fallback: that would change what is measured.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import redis

from omni_runtime.local.launcher import RedisServer
from omni_runtime.redis_io.clients import probe, sync_client


@contextlib.contextmanager
def redis_for_run(url: str | None) -> Iterator[str]:
    """`url`, or a private redis-server's URL for the duration (its log in a temp dir)."""
    if url:
        yield url
        return
    with (
        tempfile.TemporaryDirectory(prefix="omni-bench-redis-") as tmp,
        RedisServer(log_path=Path(tmp) / "redis-server.log") as server,
    ):
        yield server.url


def delete_keys(url: str, pattern: str) -> None:
    """UNLINK every key matching `pattern`, best effort: a shared Redis keeps no bench keys
    (on a cluster, the cluster client's SCAN walks every primary)."""
    client = sync_client(url, cluster=probe(url))
    try:
        for key in client.scan_iter(match=pattern, count=1000):
            client.unlink(key)
    except redis.RedisError:
        pass
    finally:
        client.close()


def server_pid(url: str) -> int | None:
    """The server's pid when it runs on this machine as a redis/valkey process, else None."""
    client = redis.Redis.from_url(url)
    try:
        pid = int(client.info("server").get("process_id", 0))
    except (redis.RedisError, ValueError):
        return None
    finally:
        client.close()
    try:
        comm = Path(f"/proc/{pid}/comm").read_text() if pid else ""
    except OSError:
        return None
    return pid if ("redis" in comm or "valkey" in comm) else None


def server_version(url: str) -> str | None:
    client = redis.Redis.from_url(url)
    try:
        return str(client.info("server").get("redis_version"))
    except redis.RedisError:
        return None
    finally:
        client.close()
