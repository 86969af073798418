"""The Redis connection layer: hiredis for small commands gives redis-py's exact bytes, and
the part of redis-py below its command API that the layer uses keeps its shape."""

from __future__ import annotations

import ast
import asyncio
import inspect
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.connection as aioconnection
from redis.connection import PythonRespSerializer
from redis.exceptions import DataError

from omni_runtime.redis_io.clients import async_client
from omni_runtime.redis_io.conn import (
    SMALL_ARG_BYTES,
    SmallFirstAsync,
    SmallFirstPacker,
    one_timeout,
    pack_small,
    read_stream,
    small_first_async,
)

ENCODE = redis.ConnectionPool().get_encoder().encode


def python_bytes(*args: Any) -> bytes:
    packed = PythonRespSerializer(6000, ENCODE).pack(*args)
    return b"".join(bytes(p) for p in packed)


@pytest.mark.parametrize(
    "args",
    [
        ("SET", "omni:{r1}:chunk:1:0", b"\x00\x01payload", "PX", 60000),
        ("XADD", "omni:s", "MAXLEN", "~", 1000, "*", "p", b"x" * 200),
        ("CLIENT UNBLOCK", 17, "ERROR"),
        ("SET", "k", "é ünïcode"),
        ("ZADD", "z", 0.1, "a", 1e20, "b", -5, "c", 2**70, "d"),
        ("SET", "k", b"y" * SMALL_ARG_BYTES),
    ],
)
def test_small_commands_pack_to_the_bytes_redis_py_would_send(args: tuple[Any, ...]) -> None:
    assert pack_small(args) == python_bytes(*args)
    assert b"".join(SmallFirstPacker(6000, ENCODE).pack(*args)) == python_bytes(*args)


@pytest.mark.parametrize(
    "value", [b"z" * (SMALL_ARG_BYTES + 1), memoryview(b"ab"), bytearray(b"ab")]
)
def test_big_or_unusual_values_go_to_the_python_packer_unchanged(value: Any) -> None:
    assert pack_small(("SET", "k", value)) is None
    packed = SmallFirstPacker(6000, ENCODE).pack("SET", "k", value)
    assert b"".join(bytes(p) for p in packed) == python_bytes("SET", "k", value)


@pytest.mark.parametrize("value", [None, True])
def test_a_value_redis_py_refuses_is_refused_with_its_error(value: Any) -> None:
    with pytest.raises(DataError):
        SmallFirstPacker(6000, ENCODE).pack("SET", "k", value)


async def test_one_timeout_bounds_a_pipeline_whose_server_never_answers() -> None:
    """The replies' shared deadline replaces redis-py's per-reply timer: a silent server
    still ends in `TimeoutError` when the block's time is up, not at redis-py's 5 s."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never replies
    client = async_client(f"redis://127.0.0.1:{silent.getsockname()[1]}")
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            async with one_timeout(0.3), client.pipeline(transaction=False) as pipe:
                pipe.set("k", "v")
                pipe.get("k")
                await pipe.execute()
        assert time.monotonic() - t0 < 3.0
    finally:
        await asyncio.wait_for(client.aclose(), 5)
        silent.close()


async def test_replies_inside_one_timeout_are_the_same(redis_url: str) -> None:
    client = async_client(redis_url)
    try:
        async with one_timeout(5), client.pipeline(transaction=False) as pipe:
            pipe.set("one-timeout", "v")
            pipe.get("one-timeout")
            pipe.delete("one-timeout")
            assert await pipe.execute() == [True, b"v", 1]
    finally:
        await client.aclose()


async def test_a_send_the_socket_cannot_take_whole_times_out_as_redis_pys_would() -> None:
    """Only a buffered write waits (`SmallFirstAsync.send_packed_command`): a server that
    reads nothing still ends the send in redis-py's write timeout, and the connection is
    dropped, as redis-py's own send does."""
    deaf = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never reads
    try:  # no CLIENT SETINFO, no HELLO: their replies would never come
        conn = small_first_async(aioconnection.Connection)(
            port=deaf.getsockname()[1], socket_timeout=0.3, driver_info=None, protocol=2
        )
        await conn.connect()
        big = b"x" * (64 << 20)  # more than any socket buffer takes
        t0 = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError, match="writing"):
            await conn.send_packed_command(conn.pack_command("SET", "k", big))
        assert time.monotonic() - t0 < 3.0
        assert conn._writer is None
        await conn.disconnect()
    finally:
        deaf.close()


async def test_a_send_the_socket_takes_whole_is_answered(redis_url: str) -> None:
    client = async_client(redis_url)
    try:
        conn = await client.connection_pool.get_connection()
        assert SmallFirstAsync in type(conn).__mro__  # the path under test
        await conn.send_packed_command(
            conn.pack_commands([("SET", "whole", "v"), ("GET", "whole")])
        )
        assert [await conn.read_response(), await conn.read_response()] == [b"OK", b"v"]
        await client.connection_pool.release(conn)
        assert await client.delete("whole") == 1
    finally:
        await client.aclose()


# --- the part of redis-py below its command API that `redis_io/conn.py` uses ----------
# redis-py does not promise to keep these; `pyproject.toml` bounds it to the releases CI
# runs, and these fail the day one changes shape (then `conn.py` is the one module to fix).

SYNC_METHODS = {
    "pack_commands": ["self", "commands"],
    "pack_command": ["self", "args"],
    "send_packed_command": ["self", "command", "check_health"],
    "can_read": ["self", "timeout"],
    "register_connect_callback": ["self", "callback"],
    "connect_check_health": ["self", "check_health", "retry_socket_connect"],
}
ASYNC_METHODS = {
    "pack_commands": ["self", "commands"],
    "pack_command": ["self", "args"],
    "send_packed_command": ["self", "command", "check_health"],
    "read_response": [
        "self",
        "disable_decoding",
        "timeout",
        "disconnect_on_error",
        "push_request",
    ],
    "connect_check_health": ["self", "check_health", "retry_socket_connect"],
}


def _parameters(cls: type, name: str) -> list[str]:
    return list(inspect.signature(getattr(cls, name)).parameters)


@pytest.mark.parametrize(("name", "parameters"), SYNC_METHODS.items())
def test_the_sync_connection_methods_conn_uses_keep_their_shape(
    name: str, parameters: list[str]
) -> None:
    assert _parameters(redis.connection.AbstractConnection, name) == parameters


@pytest.mark.parametrize(("name", "parameters"), ASYNC_METHODS.items())
def test_the_async_connection_methods_conn_uses_keep_their_shape(
    name: str, parameters: list[str]
) -> None:
    assert _parameters(aioconnection.AbstractConnection, name) == parameters


def test_the_attributes_conn_uses_are_still_there() -> None:
    sync_conn = redis.connection.Connection()
    assert sync_conn._sock is None  # the socket `socket_of` hands to `select`
    assert "read_response" in dir(sync_conn) and "disconnect" in dir(sync_conn)
    async_conn = aioconnection.Connection()
    assert async_conn._writer is None  # the stream `write_now` writes to
    assert async_conn.health_check_interval == 0  # a send checking health: redis-py's path
    pool = redis.ConnectionPool()
    assert isinstance(pool.connection_kwargs, dict)  # `command_packer`, `client_name`
    assert callable(pool.get_connection) and callable(pool.release) and callable(pool.get_encoder)
    assert _parameters(PythonRespSerializer, "__init__") == ["self", "buffer_cutoff", "encode"]
    async_pool = aioredis.ConnectionPool()
    assert issubclass(async_pool.connection_class, aioconnection.AbstractConnection)
    assert isinstance(async_pool.connection_kwargs, dict)


def test_the_cluster_slot_finder_conn_overrides_keeps_its_shape() -> None:
    """`StreamRoutedCluster` overrides it: a stream read's slot without COMMAND GETKEYS."""
    assert _parameters(aiocluster.RedisCluster, "_determine_slot") == ["self", "command", "args"]
    assert inspect.iscoroutinefunction(aiocluster.RedisCluster._determine_slot)


PRIVATE = {
    "_determine_slot",
    "connect_check_health",
    "pack_commands",
    "pack_command",
    "send_packed_command",
    "read_response",
    "can_read",
    "register_connect_callback",
    "get_connection",
    "connection_kwargs",
    "get_encoder",
    "connection_class",
    "PythonRespSerializer",
}


POOL_ONLY = {"connection_kwargs", "connection_class", "get_connection", "get_encoder"}
"""Private only on a connection pool (`SentinelTarget.connection_kwargs` is a URL's options)."""


def test_only_conn_touches_redis_py_below_its_command_api() -> None:
    """Exactly one module (`redis_io/conn.py`) calls the part of redis-py that it does not
    promise to keep, so a redis-py release that changes it breaks one module, not eight."""
    package = Path(__file__).resolve().parents[2] / "omni_runtime"
    users = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.name
                if isinstance(node, ast.alias)
                else None
            )
            on_a_pool = isinstance(node, ast.Attribute) and "pool" in ast.unparse(node.value)
            if (name in PRIVATE and (name not in POOL_ONLY or on_a_pool)) or (
                isinstance(node, ast.Attribute)
                and node.attr in ("_sock", "_writer")
                and isinstance(node.value, ast.Name)
                and node.value.id == "conn"
            ):
                users.add(str(path.relative_to(package)))
    assert users == {"redis_io/conn.py"}


@pytest.mark.parametrize(
    ("args", "stream"),
    [
        (("XREAD", "COUNT", 1, "BLOCK", 5, "STREAMS", "a", "b", "0", "0"), "a"),
        ((b"xread", b"streams", b"k", b"0"), b"k"),
        (("XREADGROUP", "GROUP", "streams", "STREAMS", "NOACK", "STREAMS", "k", ">"), "k"),
        (("XREADGROUP", "GROUP", "g", "c", "COUNT", 10, "STREAMS", "k", "0"), "k"),
        (("GET", "k"), None),
        (("XREAD", "COUNT", 1), None),
        ((), None),
    ],
)
def test_a_stream_reads_slot_comes_from_its_first_stream(
    args: tuple[Any, ...], stream: Any
) -> None:
    """A group or consumer named STREAMS is not the keyword (`read_stream`)."""
    assert read_stream(args) == stream
