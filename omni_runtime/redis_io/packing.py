"""Turning commands into RESP bytes: hiredis for the many small ones, Python for big values.

Per command, hiredis's `pack_command` takes ~3 µs where redis-py's Python packer takes
15-20 µs, and a chunk or an output costs a stage several commands. But hiredis copies
every argument into a fresh buffer, ~5x slower than the Python packer for MiB-size
values, which audio and tensor chunks are. So a command whose arguments are all small
str/bytes/int/float goes to hiredis, anything else (big, memoryview, a type redis-py
refuses with its own error) to redis-py's packer, unchanged.

Replies: redis-py's asyncio connection reads every reply under its own `socket_timeout`
timer (set and cancelled per command of a pipeline: ~10 % of an orchestrator's CPU).
Inside `one_timeout`, a pipeline's replies share that one deadline instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from typing import Any

from redis.asyncio.connection import AbstractConnection as AsyncConnection
from redis.connection import PythonRespSerializer

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # redis-py without hiredis: its Python packer for everything
    _hiredis_pack = None

SMALL_ARG_BYTES = 16 * 1024
"""Largest argument hiredis packs; above it the Python packer avoids the copy."""


def pack_small(args: tuple[Any, ...]) -> bytes | None:
    """hiredis's packing of `args`, or None for the Python packer (see the module docstring)."""
    if _hiredis_pack is None:
        return None
    name = args[0]
    if isinstance(name, str) and " " in name:  # "CLIENT UNBLOCK": redis-py splits these too
        args = (*name.split(), *args[1:])
    for arg in args:
        kind = type(arg)
        if kind is bytes or kind is str:
            if len(arg) > SMALL_ARG_BYTES:
                return None
        elif kind is not int and kind is not float:
            return None
    packed: bytes = _hiredis_pack(args)
    return packed


class SmallFirstPacker:
    """A sync connection's `command_packer`: `pack_small`, else redis-py's Python packer."""

    def __init__(self, buffer_cutoff: int, encode: Callable[[Any], bytes]) -> None:
        self._python = PythonRespSerializer(buffer_cutoff, encode)

    def pack(self, *args: Any) -> list[bytes]:
        packed = pack_small(args)
        if packed is None:
            return self._python.pack(*args)  # type: ignore[no-any-return]
        return [packed]


_ONE_TIMEOUT: ContextVar[bool] = ContextVar("omni_one_timeout", default=False)


@contextlib.asynccontextmanager
async def one_timeout(seconds: float) -> AsyncIterator[None]:
    """Every reply read in this block (this task) waits under one deadline of `seconds`,
    not under a timer per reply; past it, `TimeoutError` as a read timeout would raise."""
    token = _ONE_TIMEOUT.set(True)
    try:
        async with asyncio.timeout(seconds):
            yield
    finally:
        _ONE_TIMEOUT.reset(token)


class SmallFirstAsync:
    """Mixed into an asyncio connection class: the same choice for `pack_command`, and
    replies read without a timer of their own inside `one_timeout`."""

    async def read_response(
        self,
        disable_decoding: bool = False,
        timeout: float | None = None,
        *,
        disconnect_on_error: bool = True,
        push_request: bool | None = False,
    ) -> Any:
        if timeout is None and _ONE_TIMEOUT.get():
            timeout = math.inf  # redis-py: read with no timer (the block's deadline holds)
        # The next class's (a sentinel connection's turns READONLY into a reconnect).
        return await super().read_response(  # type: ignore[misc]
            disable_decoding,
            timeout,
            disconnect_on_error=disconnect_on_error,
            push_request=push_request,
        )

    def pack_command(self, *args: Any) -> list[bytes]:
        packed = pack_small(args)
        if packed is None:
            return AsyncConnection.pack_command(self, *args)  # type: ignore[arg-type]
        return [packed]


_ASYNC_CLASSES: dict[type, type] = {}


def small_first_async(connection_class: type) -> type:
    """`connection_class` (plain, TLS or unix socket) with `SmallFirstAsync` mixed in."""
    cls = _ASYNC_CLASSES.get(connection_class)
    if cls is None:
        cls = type(
            f"SmallFirst{connection_class.__name__}", (SmallFirstAsync, connection_class), {}
        )
        _ASYNC_CLASSES[connection_class] = cls
    return cls
