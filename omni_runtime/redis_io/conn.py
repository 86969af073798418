"""The one Redis connection layer: every use of redis-py below its command API is here.

The runtime packs round trips by hand on connections it holds (outputs, chunks, wake-up
reads, the writer's batches, held reads): redis-py's command path costs more than they do.
That calls what redis-py does not promise to keep (`pack_commands`, `send_packed_command`,
`read_response`, `can_read`, sockets, writers, pool internals, `_determine_slot`): only
here; `tests/unit/test_redis_conn.py` fails if any of it changes shape, and
`pyproject.toml` bounds redis-py to the releases CI runs.

Packing: hiredis's `pack_command` is several times faster than redis-py's Python packer,
but copies every argument, slower for MiB-size audio and tensor values: so a command of
small str/bytes/int/float goes to hiredis, anything else to redis-py's packer.

Timers: redis-py's asyncio connection sends under a `wait_for` task and reads each reply
under a timer (a share of an orchestrator's CPU). Here a send waits only when buffered,
and inside `one_timeout` replies share one deadline (both in docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.connection
import redis.asyncio.sentinel as aiosentinel
import redis.connection
import redis.sentinel
from redis.asyncio.connection import AbstractConnection as AsyncConnection
from redis.connection import AbstractConnection, Connection, ConnectionPool, PythonRespSerializer
from redis.exceptions import ResponseError

Command = tuple[Any, ...]

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
    return _hiredis_pack(args)


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

    async def send_packed_command(
        self, command: bytes | str | Sequence[bytes], check_health: bool = True
    ) -> None:
        """redis-py's send without its `wait_for` task (one per send: a share of an
        orchestrator's and a client's CPU, docs/performance.md) when the socket takes the
        write whole; only a buffered write waits, through redis-py's drain and timeout."""
        conn: Any = self
        redis_py: Any = super()  # the connection class this is mixed into
        if conn._writer is None or (check_health and conn.health_check_interval):
            await redis_py.send_packed_command(command, check_health)
            return
        if isinstance(command, str):
            command = command.encode()
        write_chunks(conn._writer, [command] if isinstance(command, bytes) else list(command))
        if conn._writer.transport.get_write_buffer_size():
            await redis_py.send_packed_command([], False)

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


PACKER_BUFFER_CUTOFF = 6000
"""redis-py's own: arguments longer than this are sent as buffers of their own (no copy)."""


def use_small_first(pool: ConnectionPool) -> None:
    """Give every connection of a sync `pool` the `SmallFirstPacker`, built from the pool's
    own encoder so str arguments are encoded as the URL says (hiredis encodes UTF-8 only);
    the pool hands this one stateless packer to every connection."""
    encoder = pool.get_encoder()
    packer = SmallFirstPacker if _is_utf8(encoder) else PythonRespSerializer
    pool.connection_kwargs["command_packer"] = packer(PACKER_BUFFER_CUTOFF, encoder.encode)


def use_small_first_async(pool: aioredis.ConnectionPool) -> None:
    """`use_small_first` for an asyncio pool: its connection class gets `SmallFirstAsync`."""
    if _is_utf8(pool.get_encoder()):  # hiredis encodes str as UTF-8, strictly
        pool.connection_class = small_first_async(pool.connection_class)


def _is_utf8(encoder: Any) -> bool:
    return bool(
        encoder.encoding.lower().replace("-", "") == "utf8" and encoder.encoding_errors == "strict"
    )


def name_connections(client: redis.Redis | aioredis.Redis, name: str) -> None:
    """Every connection `client`'s pool makes from now on says `name` (CLIENT SETNAME), so
    another process can close them by name (CLIENT KILL)."""
    client.connection_pool.connection_kwargs["client_name"] = name


def pool_option(client: redis.Redis, key: str) -> Any:
    """One of the options `client`'s connections are made with (e.g. `socket_timeout`)."""
    return client.connection_pool.connection_kwargs.get(key)


# --- sync: a connection held out of a pool ----------------------------------------------


def take(pool: ConnectionPool) -> Connection:
    """A connection of `pool`'s, connected, held by the caller until `give_back`."""
    return pool.get_connection()


def give_back(pool: ConnectionPool, conn: Connection) -> None:
    pool.release(conn)


def socket_of(conn: AbstractConnection) -> socket.socket | None:
    """The connection's socket, for `select` (None: not a plain socket, e.g. a stand-in)."""
    sock = getattr(conn, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def packed(conn: AbstractConnection, commands: Sequence[Command]) -> bytes:
    return b"".join(conn.pack_commands(commands))  # packed once, for `send` to write again


def send(conn: AbstractConnection, commands: Sequence[Command] | bytes, check: bool = True) -> None:
    """Pack `commands` (bytes: by `packed`) and write them in one send; `reply` reads."""
    data = [commands] if isinstance(commands, bytes) else conn.pack_commands(commands)
    conn.send_packed_command(data, check_health=check)


def reply(conn: AbstractConnection) -> Any:
    """The next reply, raw (RESP as parsed: no reply callback); an error reply raises."""
    return conn.read_response()


def replies(conn: AbstractConnection, count: int) -> list[Any]:
    """The next `count` replies, an error reply as its `ResponseError` in its place."""
    out: list[Any] = []
    for _ in range(count):
        try:
            out.append(conn.read_response())
        except ResponseError as e:  # read whole: the connection is still in step
            out.append(e)
    return out


def readable(conn: AbstractConnection) -> bool:
    """A reply (or part of one) is waiting: reading it will not block."""
    return bool(conn.can_read(timeout=0))


@contextlib.contextmanager
def in_step(
    conn: AbstractConnection,
    on_failure: Callable[[], None] | None = None,
    keep_on_error_reply: bool = False,
) -> Iterator[None]:
    """A round trip on `conn`: whatever stops it midway drops the connection (`on_failure`,
    else a disconnect): a reply half read must never be read as the next command's (an
    error reply read whole leaves it, with `keep_on_error_reply`)."""
    whole = False
    try:
        yield
        whole = True
    except ResponseError:  # an error reply, read whole
        whole = keep_on_error_reply
        raise
    finally:
        if not whole:  # a timeout, a cancellation, a signal: any may have cut a reply
            (on_failure or conn.disconnect)()


def round_trip(conn: AbstractConnection, commands: Sequence[Command]) -> list[Any]:
    """Send every command, read every reply; a failure disconnects `conn` and raises."""
    with in_step(conn):
        send(conn, commands)
        return [conn.read_response() for _ in commands]


def drop(conn: AbstractConnection) -> None:
    conn.disconnect()  # replies left unread must never be read as another command's


def on_connect(conn: AbstractConnection, callback: Callable[[AbstractConnection], None]) -> None:
    """Call `callback(conn)` on every (re)connection of `conn`."""
    conn.register_connect_callback(callback)


# --- asyncio -------------------------------------------------------------------------


async def take_async(pool: aioredis.ConnectionPool) -> AsyncConnection:
    return await pool.get_connection()  # type: ignore[no-any-return]


def write_now(conn: AsyncConnection, commands: Sequence[Command]) -> None:
    """Write `commands` to `conn` (connected) now: the socket or its buffer (`drain`) takes them."""
    if conn._writer is None:
        raise redis.exceptions.ConnectionError("not connected")
    write_chunks(conn._writer, conn.pack_commands(commands))


BIG_CHUNK_BYTES = 64 * 1024


def write_chunks(writer: asyncio.StreamWriter, chunks: Sequence[bytes | memoryview]) -> None:
    """`writelines` without copying a big value (the Python packer's own buffer) into one
    joined buffer first, as Python 3.11's does: small chunks joined, big ones as they are."""
    start = 0
    for i, chunk in enumerate(chunks):
        if len(chunk) >= BIG_CHUNK_BYTES:
            if i > start:
                writer.writelines(chunks[start:i])
            writer.writelines((chunk,))  # one bytes: joined as is, no copy
            start = i + 1
    if start < len(chunks):
        writer.writelines(chunks[start:])


async def drain(conn: AsyncConnection) -> None:
    if conn._writer is not None:
        await conn._writer.drain()


async def send_async(
    conn: AsyncConnection, commands: Sequence[Command], check_health: bool = True
) -> None:
    """Several commands in one write; their replies are read in order after it."""
    await conn.send_packed_command(conn.pack_commands(commands), check_health)


async def reply_async(conn: AsyncConnection) -> Any:
    return await conn.read_response()


@contextlib.asynccontextmanager
async def in_step_async(conn: AsyncConnection) -> AsyncIterator[None]:
    """`in_step` for an asyncio connection: a round trip stopped midway disconnects it."""
    whole = False
    try:
        yield
        whole = True
    finally:
        if not whole:  # a timeout, a cancellation: any may have left a reply half read
            await conn.disconnect()


# --- Sentinel: a connection that follows the primary ----------------------------------

# redis-py's Sentinel connection finds the primary in `connect()`, but one reconnecting
# through `connect_check_health()` (a held connection's next command) goes to the address
# it had, the dead primary's, for ever. These ask the sentinels on that path too.


class FollowingConnection(redis.sentinel.SentinelManagedConnection):
    """A sync Sentinel connection that finds the primary on every reconnect."""

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health, retry_socket_connect)


class FollowingSSLConnection(FollowingConnection, redis.connection.SSLConnection):
    pass


class AsyncFollowingConnection(aiosentinel.SentinelManagedConnection):
    """`FollowingConnection` for asyncio."""

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health, retry_socket_connect)


class AsyncFollowingSSLConnection(AsyncFollowingConnection, redis.asyncio.connection.SSLConnection):
    pass


# --- Redis Cluster: stream reads routed without asking a node --------------------------


def read_stream(args: tuple[Any, ...]) -> Any | None:
    """The first stream of an XREAD / XREADGROUP command (all of one read share a slot).

    redis-py finds the keys of those commands (they move) with COMMAND GETKEYS, two round
    trips to a node before each read on a cluster; the stream after STREAMS is the key."""
    name = args[0].upper() if args and isinstance(args[0], str | bytes) else None
    if name not in ("XREAD", "XREADGROUP", b"XREAD", b"XREADGROUP"):
        return None
    first = 4 if name in ("XREADGROUP", b"XREADGROUP") else 1  # past GROUP group consumer
    for i in range(first, len(args) - 1):
        if isinstance(args[i], str | bytes) and args[i].upper() in ("STREAMS", b"STREAMS"):
            return args[i + 1]
    return None


class StreamRoutedCluster(aiocluster.RedisCluster):
    """redis-py's asyncio cluster client, its stream reads' slot found by `read_stream`."""

    async def _determine_slot(self, command: str, *args: Any) -> int:
        stream = read_stream((command, *args))
        if stream is None:
            return await super()._determine_slot(command, *args)
        return self.keyslot(stream)
