"""The command packer: hiredis for small commands must give redis-py's exact bytes."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
import redis
from redis.connection import PythonRespSerializer
from redis.exceptions import DataError

from omni_runtime.redis_io.clients import async_client
from omni_runtime.redis_io.packing import SMALL_ARG_BYTES, SmallFirstPacker, one_timeout, pack_small

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
