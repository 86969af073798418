"""The command packer: hiredis for small commands must give redis-py's exact bytes."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from redis.connection import PythonRespSerializer
from redis.exceptions import DataError

from omni_runtime.redis_io.packing import SMALL_ARG_BYTES, SmallFirstPacker, pack_small

ENCODE = redis.ConnectionPool().get_encoder().encode


def python_bytes(*args: Any) -> bytes:
    packed = PythonRespSerializer(6000, ENCODE).pack(*args)  # type: ignore[no-untyped-call]
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
