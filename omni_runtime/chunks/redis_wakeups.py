"""Chunk wake-ups of the Redis connector: a receiver blocks instead of polling (SPEC §5).

A receiver `listen`s to a `<req>_<stage>` route by pointing its route key at the
receiver's own notify list; a sender that knows the route RPUSHes one wake-up per
chunk there, in the round trip of the SETs. `WakeupSender` is the sender's side
(which routes lead where, and the wake-up elements), `WakeupListener` the
receiver's (the route keys, the thread blocked on the list, the `on_put`
callbacks it calls, and the small values that arrived inline). `RedisConnector`
composes both.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from redis.client import Pipeline
from redis.exceptions import RedisError

from omni_runtime import keys
from omni_runtime.errors import TransportError

log = logging.getLogger(__name__)

LISTEN_BLOCK_S = 1.0
"""Longest BLPOP of the wake-up listener; bounds how long `close` may wait for it."""
MAX_CACHED_ROUTES = 100_000
LISTEN_BATCH = 10_000
INLINE_MAX_BYTES = 16 * 1024
"""Chunks up to this size also travel inside their wake-up: one round trip less per hop."""
MAX_INLINE_HELD = 10_000
_WAKEUP_HEADER = struct.Struct("<H")


def _parse_wakeup(element: bytes) -> tuple[str | None, bytes]:
    """`<u16 key length><key><value or nothing>`; None for anything else (logged).

    The empty element is `close()` unblocking the listener: no key, nothing to log.
    """
    if not element:
        return None, b""
    try:
        (n,) = _WAKEUP_HEADER.unpack_from(element)
        return element[2 : 2 + n].decode(), element[2 + n :]
    except (struct.error, UnicodeDecodeError) as e:
        log.warning("malformed wake-up ignored: %r", e)
        return None, b""


class WakeupSender:
    """The sender's side: each route's notify list once looked up (a bounded cache), and
    the wake-ups for it. `encoded` items are `(full key, msgpack value, route id)`."""

    def __init__(self, prefix: str, ttl_s: int) -> None:
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._routes: dict[str, str] = {}

    def queue(self, pipe: Pipeline, encoded: list[tuple[str, bytes, str]]) -> list[str]:
        """Queue on `pipe` (after its SETs) the wake-ups of the routes known, and a GET of
        the route key of the others; return those others, whose GETs end the replies."""
        route_ids = list(dict.fromkeys(route_id for _n, _v, route_id in encoded))
        with self._lock:
            routes = {r: self._routes.get(r) for r in route_ids}
        unknown = [r for r in route_ids if routes[r] is None]
        for route_id, route in routes.items():
            if route is not None:
                pipe.rpush(route, *self._wakeups(encoded, route_id))
                pipe.expire(route, self.ttl_s)
        for route_id in unknown:
            pipe.get(keys.chunk_route_key(route_id, self.prefix))
        return unknown

    def wake_found(
        self,
        client: redis.Redis,
        encoded: list[tuple[str, bytes, str]],
        unknown: list[str],
        replies: Sequence[Any],
    ) -> None:
        """Wake the `unknown` routes whose GET (the last of `replies`) found a receiver."""
        found = {
            route_id: reply.decode()
            for route_id, reply in zip(unknown, replies[len(replies) - len(unknown) :], strict=True)
            if reply is not None
        }
        if not found:
            return
        # Receivers that listen but were not known yet: wake them now, then remember them.
        # The SETs came before the GETs, so a receiver that starts listening later polls first.
        with client.pipeline(transaction=False) as pipe:
            for route_id, route in found.items():
                pipe.rpush(route, *self._wakeups(encoded, route_id))
                pipe.expire(route, self.ttl_s)
            pipe.execute()
        with self._lock:
            if len(self._routes) + len(found) > MAX_CACHED_ROUTES:
                self._routes.clear()
            self._routes.update(found)

    def forget(self, route_ids: Iterable[str]) -> None:
        """Drop finished routes: no chunk follows, so their receivers need no more wake-ups."""
        with self._lock:
            for route_id in route_ids:
                self._routes.pop(route_id, None)

    def _wakeups(self, encoded: list[tuple[str, bytes, str]], route_id: str) -> list[bytes]:
        """One wake-up per chunk of the route: its key, and the value itself when small, so
        the receiver has it without another round trip (the SET stays the source of truth)."""
        out = []
        for name, value, rid in encoded:
            if rid != route_id:
                continue
            key = name[len(self.prefix) :].encode()
            inline = value if len(value) <= INLINE_MAX_BYTES else b""
            out.append(_WAKEUP_HEADER.pack(len(key)) + key + inline)
        return out


class WakeupListener:
    """The receiver's side: a thread blocked on `notify_key` (started by the first
    `on_put`) that calls the callbacks, and the small values that came inline."""

    def __init__(self, client: redis.Redis, notify_key: str, prefix: str) -> None:
        self.client = client
        self.notify_key = notify_key
        self.prefix = prefix
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[str], None]] = []
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._inline: dict[str, bytes] = {}
        """Small chunk values that arrived with their wake-up, by full key, until peeked."""
        self._consumed_recently: dict[str, None] = {}
        """Keys read and deleted lately (bounded): a wake-up arriving after them is stale."""

    def listen(self, route_ids: Sequence[str], ttl_s: int) -> None:
        """Point the route keys of these `<req>_<stage>` routes at `notify_key`, for `ttl_s`."""
        if not route_ids:
            return
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for route_id in route_ids:
                    pipe.set(keys.chunk_route_key(route_id, self.prefix), self.notify_key, ex=ttl_s)
                pipe.execute()
        except RedisError as e:
            raise TransportError(f"registering {len(route_ids)} route(s) failed: {e}") from e

    def on_put(self, callback: Callable[[str], None]) -> None:
        """Call `callback(<req>_<stage>)` (on a listener thread) for each put we listen to."""
        with self._lock:
            self._callbacks.append(callback)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._listen_loop, name="chunk-wakeups", daemon=True
                )
                self._thread.start()

    def take_inline(self, names: Sequence[str], consumed: Iterable[str]) -> dict[str, bytes]:
        """Pop the values of `names` (full keys) that came inline, then mark `consumed`."""
        with self._lock:
            inline = {n: self._inline.pop(n) for n in names if n in self._inline}
            self._remember_consumed(consumed)
        return inline

    def mark_consumed(self, names: Iterable[str]) -> None:
        """`names` (full keys) were read and deleted: drop their inline values, and ignore
        a wake-up of theirs that arrives late."""
        with self._lock:
            self._remember_consumed(names)

    def close(self) -> None:
        """Stop the listener thread, if one runs; the client stays open."""
        self._closed.set()
        if self._thread is not None:
            with contextlib.suppress(RedisError):
                self.client.rpush(self.notify_key, "")  # unblock its BLPOP now
                self.client.delete(self.notify_key)
            self._thread.join(LISTEN_BLOCK_S + 1)

    def _listen_loop(self) -> None:
        delay_s = 0.05
        while not self._closed.is_set():
            try:
                with self.client.pipeline(transaction=False) as pipe:
                    pipe.blpop([self.notify_key], timeout=LISTEN_BLOCK_S)
                    pipe.lpop(self.notify_key, LISTEN_BATCH)  # and whatever queued behind it
                    popped, rest = pipe.execute()
                delay_s = 0.05
            except RedisError as e:
                log.warning("chunk wake-up listener failed, retrying in %.2fs: %r", delay_s, e)
                self._closed.wait(delay_s)
                delay_s = min(2.0, delay_s * 2)
                continue  # receivers sweep their parked requests meanwhile
            if popped is None:
                continue
            route_ids: dict[str, None] = {}
            for element in [popped[1], *(rest or [])]:
                key, value = _parse_wakeup(element)
                if key is None:
                    continue
                route_ids[key.rsplit("_", 1)[0]] = None
                if value:
                    with self._lock:
                        if self.prefix + key in self._consumed_recently:
                            continue  # already read from Redis and deleted: a stale copy
                        self._inline[self.prefix + key] = value
                        while len(self._inline) > MAX_INLINE_HELD:
                            self._inline.pop(next(iter(self._inline)))
            with self._lock:
                callbacks = list(self._callbacks)
            for route_id in route_ids:
                for callback in callbacks:
                    callback(route_id)
            time.sleep(0)  # hand the GIL to the woken receiver before packing the next BLPOP

    def _remember_consumed(self, names: Iterable[str]) -> None:
        """Under `_lock`."""
        for name in names:
            self._inline.pop(name, None)
            self._consumed_recently[name] = None
        while len(self._consumed_recently) > MAX_INLINE_HELD:
            self._consumed_recently.pop(next(iter(self._consumed_recently)))
