"""Redis Sentinel with real sentinels: connections follow the primary through a failover.

The runtime hand-packs commands on connections it holds outside the pool (stream reads,
output writes, chunk puts), so those must follow a failover too: after `SENTINEL
FAILOVER` the old primary is a replica that answers writes with READONLY, and after a
SIGKILL it is gone; either way the next command on the held connection reaches the new
primary. The status tool and the serve process take a sentinel URL like any other.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from omni_runtime.errors import OmniError
from omni_runtime.local.redis_sentinel import SERVICE, RedisSentinelSet
from omni_runtime.local.redis_server import redis_server_binary
from omni_runtime.redis_io.clients import async_client, sync_client
from omni_runtime.redis_io.sentinel import AsyncSentinelRedis, SentinelRedis
from tests.services import unavailable
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]


@pytest.fixture
def private_sentinels() -> Iterator[RedisSentinelSet]:
    """A set of the test's own: these tests move its primary."""
    if redis_server_binary() is None:
        unavailable("no redis-server on PATH", "redis-server (for redis-server --sentinel)")
    ha = RedisSentinelSet(down_after_ms=1000)
    try:
        ha.start()
    except OmniError as e:
        unavailable(f"cannot start Redis Sentinel: {e}", "redis-server --sentinel")
    try:
        yield ha
    finally:
        ha.stop()


def role(port: int) -> str:
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        return str(client.info("replication")["role"])
    finally:
        client.close()


def send(conn: Any, *args: Any) -> Any:
    """One command on a held connection, sent again while it fails for want of a primary
    (a dead socket, sentinels not yet agreed on the new one), as the runtime's loops do:
    within 10 s it must reach the primary."""
    deadline = time.monotonic() + 10
    while True:
        try:
            conn.send_command(*args)
            return conn.read_response()
        except redis.ConnectionError:
            conn.disconnect()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_held_connections_follow_a_switchover_and_a_sigkill(
    private_sentinels: RedisSentinelSet,
) -> None:
    ha = private_sentinels
    client = sync_client(ha.url)
    held = client.connection_pool.get_connection()  # as the hand-packed writers hold one
    try:
        assert send(held, "SET", "k", "1") == b"OK"
        first = ha.primary_port()
        assert first is not None and held.port == first

        sentinel = redis.Redis(port=ha.sentinel_ports[0], socket_timeout=5)
        sentinel.execute_command("SENTINEL FAILOVER", SERVICE)
        sentinel.close()
        second = ha.wait_primary_other_than(first, 30)
        # Until sentinel turns the old primary into a replica it still takes writes (and
        # loses them when it does: docs/high-availability.md). Once it is one, a write there
        # is READONLY, which drops the connection, if sentinel has not closed it already:
        # the same connection reaches the new primary.
        wait_until(lambda: role(first) == "slave", 30)
        assert send(held, "SET", "k", "2") == b"OK" and held.port == second

        proc = ha.server(second).proc
        assert proc is not None
        proc.kill()
        third = ha.wait_primary_other_than(second, 30)
        assert send(held, "SET", "k", "3") == b"OK" and held.port == third == first
        assert client.get("k") == b"3"
    finally:
        client.connection_pool.release(held)
        client.close()


async def test_a_held_asyncio_connection_follows_a_sigkill(
    private_sentinels: RedisSentinelSet,
) -> None:
    ha = private_sentinels
    client = async_client(ha.url)
    held = await client.connection_pool.get_connection()
    try:
        await held.send_command("SET", "k", "1")
        assert await held.read_response() == b"OK"
        first = held.port
        proc = ha.server(first).proc
        assert proc is not None
        proc.kill()
        second = await asyncio.to_thread(ha.wait_primary_other_than, first, 30)
        deadline = time.monotonic() + 10
        while True:  # as `send`: the dead socket first, maybe sentinels not yet agreed
            try:
                await held.send_command("SET", "k", "2")
                assert await held.read_response() == b"OK"
                break
            except redis.ConnectionError:
                await held.disconnect()
                assert time.monotonic() < deadline, "no primary within 10 s"
                await asyncio.sleep(0.05)
        assert held.port == second
        assert await client.get("k") == b"2"
    finally:
        await client.connection_pool.release(held)
        await client.aclose()


async def test_every_sentinel_client_is_closed_after_concurrent_lookups_reorder_them(
    redis_sentinel_url: str,
) -> None:
    """redis-py's `discover_master` swaps the sentinel that answered to the front of the
    manager's list by index, after awaiting it. With the first sentinel failing and two
    lookups at once (every connection reconnecting in a failover): the first to hear the
    second sentinel swaps them; the other then writes that sentinel into both places, and
    the one it displaced is no longer in the list that `Sentinel.close` closes. The
    primary's client closes every sentinel client it was made with regardless."""
    aio, sync = async_client(redis_sentinel_url), sync_client(redis_sentinel_url)
    assert isinstance(aio, AsyncSentinelRedis) and isinstance(sync, SentinelRedis)
    made_aio, made_sync = aio.sentinel_clients, sync.sentinel_clients
    try:
        assert len(made_aio) == len(made_sync) == 3
        for sentinel in made_aio:
            assert await sentinel.ping()
        for sync_sentinel in made_sync:
            assert sync_sentinel.ping()
        pools: list[Any] = [aio.connection_pool, sync.connection_pool]
        for made, pool in zip((made_aio, made_sync), pools, strict=True):
            pool.sentinel_manager.sentinels[:] = [made[1], made[1], made[2]]  # the race's end
    finally:
        await aio.aclose()
        sync.close()
    still_open = [
        conn
        for sentinel in (*made_aio, *made_sync)
        for conn in sentinel.connection_pool._available_connections
        if conn.is_connected
    ]
    assert still_open == []


def test_status_reads_through_the_sentinels(redis_sentinel_url: str) -> None:
    """The operator's tool, a process of its own, given only the sentinel URL."""
    done = subprocess.run(
        [sys.executable, "-m", "omni_runtime.cli", "status", "--once", "--json"],
        env={"OMNI_REDIS_URL": redis_sentinel_url, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Exit 1: nothing runs in the namespace, which the snapshot read from the primary says.
    assert done.returncode == 1 and done.stderr == "", done.stderr
    snap = json.loads(done.stdout)
    assert (snap["orchestrators"], snap["redis_memory"]["out_of_memory"]) == (0, False)
