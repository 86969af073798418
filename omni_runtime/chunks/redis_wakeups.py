"""Chunk wake-ups over Redis: the receiver blocks instead of polling (SPEC §5).

A receiver subscribes to a `<req>_<stage>` route by pointing its route key at
its own notify list; a sender that knows the route RPUSHes one wake-up per chunk
there, in the round trip of the SETs, carrying the value too when it is small.
`WakeupSender` is the sender's side (which routes lead where). `WakeupInbox` is
the receiver's: what the wake-ups said, the small values that came inline, and
which keys they make stale. No thread: the RECV thread reads the list itself.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import redis
from redis.connection import Connection, ConnectionPool

from omni_runtime import keys
from omni_runtime.chunks.redis_packed import PutPipe
from omni_runtime.chunks.transport import route_and_id
from omni_runtime.redis_io import conn as rconn
from omni_runtime.redis_io.clients import pool_for_key

log = logging.getLogger(__name__)

MAX_CACHED_ROUTES = 100_000
WAKEUP_BATCH = 10_000
"""Most wake-ups taken off the notify list per read."""
INLINE_MAX_BYTES = 16 * 1024
"""Chunks up to this size also travel inside their wake-up: one round trip less per hop."""
MAX_HELD = 10_000
"""Bound on inline values held, and on keys remembered as read (the stale filter)."""
BLOCK_S = 1
"""Server-side timeout of the BLPOP left waiting on the dedicated connection."""
SLICE_S = 0.02
"""Without a real socket to select on (fakeredis): longest BLPOP between `kick` checks."""
_HEADER = struct.Struct("<H")

Encoded = tuple[str, bytes, str, str]
"""(full key, msgpack value, route id, the bare chunk key it was put under)."""


def _parse_wakeup(element: bytes) -> tuple[str | None, bytes]:
    """`<u16 key length><key><value or nothing>`; None for anything else (logged)."""
    try:
        (n,) = _HEADER.unpack_from(element)
        return element[2 : 2 + n].decode(), element[2 + n :]
    except (struct.error, UnicodeDecodeError) as e:
        log.warning("malformed wake-up ignored: %r", e)
        return None, b""


class WakeupSender:
    """Each route's notify list once looked up (a bounded cache), and its wake-ups."""

    def __init__(self, prefix: str, ttl_s: int) -> None:
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._routes: dict[str, str] = {}

    def queue(self, pipe: PutPipe, encoded: list[Encoded]) -> list[str]:
        """Queue on `pipe` (after its SETs) the wake-ups of the routes known, one RPUSH and
        one EXPIRE per notify list however many requests lead there, and a GET of the route
        key of the others; return those others, whose GETs end the replies."""
        with self._lock:
            routes = {rid: self._routes.get(rid) for _n, _v, rid, _k in encoded}
        unknown = [rid for rid, route in routes.items() if route is None]
        self._push(pipe, encoded, routes)
        for route_id in unknown:
            pipe.get(keys.chunk_route_key(route_id, self.prefix))
        return unknown

    def wake_found(
        self, client: redis.Redis, encoded: list[Encoded], unknown: list[str], replies: list[Any]
    ) -> None:
        """Wake the `unknown` routes whose GET (the last of `replies`) found a receiver.

        The SETs came before the GETs, so a receiver that subscribes later polls first.
        """
        found = {
            route_id: reply.decode()
            for route_id, reply in zip(unknown, replies[len(replies) - len(unknown) :], strict=True)
            if reply is not None
        }
        if not found:
            return
        with client.pipeline(transaction=False) as pipe:
            self._push(cast(PutPipe, pipe), encoded, found)
            pipe.execute()
        with self._lock:
            if len(self._routes) + len(found) > MAX_CACHED_ROUTES:
                self._routes.clear()
            self._routes.update(found)

    def forget(self, route_ids: Iterable[str]) -> None:
        """Routes whose last chunk went out: their receivers need no more wake-ups."""
        with self._lock:
            for route_id in route_ids:
                self._routes.pop(route_id, None)

    def _push(
        self, pipe: PutPipe, encoded: list[Encoded], routes: Mapping[str, str | None]
    ) -> None:
        """One RPUSH (wake-ups in put order) and one EXPIRE per notify list of `routes`."""
        lists: dict[str, list[bytes]] = {}
        for _name, value, route_id, chunk_key in encoded:
            route = routes.get(route_id)
            if route is not None:
                key = chunk_key.encode()
                inline = value if len(value) <= INLINE_MAX_BYTES else b""
                lists.setdefault(route, []).append(_HEADER.pack(len(key)) + key + inline)
        for route, wakeups in lists.items():
            pipe.rpush(route, *wakeups)
            pipe.expire(route, self.ttl_s)


class WakeupInbox:
    """The receiver's side (RECV thread only, no lock): routes woken, inline values, and
    the keys whose deletion is owed because their value was served inline. All by bare
    chunk key (`<req>_<stage>_<id>`): a value served inline never needs its Redis name."""

    def __init__(self) -> None:
        self.woken: dict[str, int] = {}
        """Routes with puts reported since last taken, and the highest chunk id of each."""
        self._inline: dict[str, bytes] = {}
        self._read: dict[str, None] = {}
        """Keys read from Redis lately (bounded): a wake-up arriving after them is stale."""
        self.unlink: dict[str, None] = {}
        """Keys served inline: deleted with the next round trip."""

    def take(self, elements: Sequence[bytes]) -> None:
        """Record the wake-ups read off the notify list."""
        for element in elements:
            key, value = _parse_wakeup(element)
            if key is None:
                continue
            if key in self.unlink:  # put again since we served it: keep the new value
                del self.unlink[key]
            elif key in self._read:  # the wake-up of a value already read: stale
                del self._read[key]
                continue
            route, chunk_id = route_and_id(key)
            self.woken[route] = max(chunk_id, self.woken.get(route, -1))
            if value:
                self._inline[key] = value
                if len(self._inline) > MAX_HELD:
                    self._inline.pop(next(iter(self._inline)))

    def serve(self, chunk_keys: Sequence[str]) -> dict[str, bytes]:
        """The values of `chunk_keys` that came inline; their deletes are owed."""
        inline = self._inline
        served = {k: inline.pop(k) for k in chunk_keys if k in inline}
        self.unlink.update(dict.fromkeys(served))
        return served

    def read(self, chunk_keys: Iterable[str]) -> None:
        """These keys were read (and deleted) in Redis."""
        for key in chunk_keys:
            self._inline.pop(key, None)
            self._read[key] = None
        while len(self._read) > MAX_HELD:
            self._read.pop(next(iter(self._read)))

    def paid(self, chunk_keys: Iterable[str]) -> None:
        """These owed deletes were sent."""
        for key in chunk_keys:
            self.unlink.pop(key, None)

    def take_woken(self) -> dict[str, int]:
        woken, self.woken = self.woken, {}
        return woken


class NotifyWaiter:
    """Blocks on one notify list until a wake-up comes or `kick` is called from any thread.

    A BLPOP (+ LPOP of what queued behind it) stays in flight on a connection of
    its own; the wait is a `select` on that socket and a local socketpair that
    `kick` writes one byte to, so a kick costs no Redis round trip and is seen
    at once. A client without real sockets (fakeredis) gets short BLPOP slices.
    """

    def __init__(self, client: redis.Redis, notify_key: str) -> None:
        self.client = client
        self.notify_key = notify_key
        self._kicked = threading.Event()
        self._pair: tuple[socket.socket, socket.socket] | None = None
        """Made on the first blocking wait: a connector that only puts holds no sockets."""
        self._conn: Connection | None = None
        self._pool: ConnectionPool | None = None
        """The pool of the server holding the notify list (a cluster node's, on a cluster)."""
        self._socket: socket.socket | None = None
        self._in_flight = False
        self._skip = 0
        """Replies ahead of the BLPOP's still to be read (the UNLINK sent with it)."""
        self._wait_cmds: bytes | None = None

    def kick(self) -> None:
        self._kicked.set()  # before looking at the pair: `wait` checks it after making one
        pair = self._pair
        if pair is not None:
            with contextlib.suppress(OSError):  # full or closed: a kick is pending anyway
                pair[1].send(b"\0")

    def wait(self, timeout_s: float, unlink: Sequence[str] = ()) -> tuple[list[bytes], bool, bool]:
        """(wake-up elements, kicked, whether `unlink` was sent): the keys are deleted in the
        packet that starts a new BLPOP, if one starts; raises `RedisError` (the connection
        is dropped)."""
        sent = False
        try:
            conn = self._connection()
            if conn is None:
                timeout_s = 0.0 if self._kicked.is_set() else timeout_s
                return self._slice(timeout_s, unlink), self._drain(), bool(unlink)
            just_sent = not self._in_flight
            if just_sent:
                if self._wait_cmds is None:  # the same two commands every time: packed once
                    blpop = ("BLPOP", self.notify_key, BLOCK_S)
                    lpop = ("LPOP", self.notify_key, WAKEUP_BATCH)
                    self._wait_cmds = rconn.packed(conn, [blpop, lpop])
                head = rconn.packed(conn, [("UNLINK", *unlink)]) if unlink else b""
                rconn.send(conn, head + self._wait_cmds)
                self._in_flight, self._skip, sent = True, int(bool(unlink)), bool(unlink)
            if self._pair is None:
                self._pair = socket.socketpair()
                for end in self._pair:
                    end.setblocking(False)
            sock, kicks = self._socket, self._pair[0]
            # Every earlier reply was read whole, so just after a send nothing can be
            # buffered that `select` would miss: the poll (three syscalls) is saved.
            readable, kick_byte = (False if just_sent else rconn.readable(conn)), False
            if not readable and sock is not None and not self._kicked.is_set():
                ready = select.select([sock, kicks], [], [], timeout_s)[0]
                readable, kick_byte = sock in ready, kicks in ready
            while self._skip and readable:  # the UNLINK's reply comes first
                rconn.reply(conn)
                self._skip -= 1
                readable = rconn.readable(conn)
            if self._skip or not readable:
                return [], self._drain(kick_byte), sent
            popped, rest = rconn.reply(conn), rconn.reply(conn)
            self._in_flight = False
        except redis.RedisError:
            self._drop()
            raise
        return [*([popped[1]] if popped else []), *(rest or [])], self._drain(kick_byte), sent

    def close(self) -> None:
        self._drop()
        if self._pair is not None:
            for end in self._pair:
                end.close()
            self._pair = None

    def _connection(self) -> Connection | None:
        if self._conn is None:
            pool = self._pool = pool_for_key(self.client, self.notify_key)
            conn = rconn.take(pool)
            sock = rconn.socket_of(conn)
            if sock is None:
                rconn.give_back(pool, conn)
                return None
            self._conn, self._socket = conn, sock
        return self._conn

    def _slice(self, timeout_s: float, unlink: Sequence[str]) -> list[bytes]:
        with self.client.pipeline(transaction=False) as pipe:
            if unlink:
                pipe.unlink(*unlink)
            if timeout_s > 0:
                pipe.blpop([self.notify_key], timeout=min(timeout_s, SLICE_S))
            pipe.lpop(self.notify_key, WAKEUP_BATCH)
            replies = pipe.execute()
        popped = replies[1 if unlink else 0] if timeout_s > 0 else None  # after UNLINK's count
        return [*([popped[1]] if popped else []), *(replies[-1] or [])]

    def _drain(self, kick_byte: bool = True) -> bool:
        """Whether a kick came; its byte is read only when one may be there (`kick` sets
        the flag before it writes: a byte the flag did not announce makes `select` report
        the pair, and is read then), which saves a wake-up a syscall."""
        kicked = self._kicked.is_set()
        self._kicked.clear()
        if self._pair is not None and (kicked or kick_byte):
            with contextlib.suppress(OSError):
                kicked |= bool(self._pair[0].recv(4096))
        return kicked

    def _drop(self) -> None:
        """A connection with a BLPOP in flight must not go back to the pool as is."""
        if self._conn is not None:
            rconn.drop(self._conn)
            if self._pool is not None:
                rconn.give_back(self._pool, self._conn)
            self._conn, self._in_flight, self._skip = None, False, 0
