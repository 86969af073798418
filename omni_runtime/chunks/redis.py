"""The chunk plane over Redis (SPEC §5): a SPEC connector and a `ChunkTransport` in one.

A put is `SET <prefix>{<req>}_<stage>_<id> <msgpack> EX <ttl_s>`, a read consumes
(`GETDEL`, or MGET + UNLINK in one MULTI), so a chunk is read at most once and a
chunk nobody reads expires. Keys handed in are the bare `<req>_<stage>_<id>`
strings; the namespace prefix and the request's hash tag are applied here
(`keys.stored_chunk_key`).

On a Redis Cluster nothing may span slots and a batch spans requests, so round trips keep
their shape, not their atomicity: a put is the SETs' pipeline, then the wake-ups' (never
before: an inline-served value's delete must not overtake its SET; a retry re-puts the
batch), a read is per-key GETDELs and UNLINKs beside the wake-ups' LPOP (docs/cluster.md).
A read takes that shape on one server too while Redis is out of memory: it refuses every
command inside a MULTI then, and a chunk read is one that frees memory.
Inside: read-ahead in one MGET, wake-ups with small values inline (`redis_wakeups`), a
route cache, puts packed by hand on a held connection (`redis_packed`), deletes of
inline-served keys riding the next round trip. Redis failures raise `TransportError`
(puts retry first, with the `Backoff` given); a value that fails to decode or exceeds
`max_bytes` is a `MalformedChunk` in `fetch` and a `CodecError` in `get`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any, cast

import msgspec
import redis
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError, RedisError
from redis.retry import Retry

from omni_runtime import keys
from omni_runtime.chunks.redis_packed import HeldPuts, put_pipe
from omni_runtime.chunks.redis_wakeups import (
    WAKEUP_BATCH,
    Encoded,
    NotifyWaiter,
    WakeupInbox,
    WakeupSender,
)
from omni_runtime.chunks.transport import ChunkRejected, Fetched, PutItem
from omni_runtime.core.types import MalformedChunk
from omni_runtime.errors import CodecError, ConfigError, TransportError
from omni_runtime.keys import stored_chunk_key
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.clients import is_cluster, sync_client
from omni_runtime.wire import codec

log = logging.getLogger(__name__)

OWED_MAX = 256
"""Deletes of inline-served keys held back at most, before a zero wait sends them anyway."""
PUT_RETRY = Backoff(initial_s=0.01, max_s=2.0, max_attempts=4)
"""Default put policy: 3 retries, 10, 20, 40 ms apart."""


class RedisConnector:
    """`put` / consume-once `get`, and the `ChunkTransport` surface, on one sync client;
    one receiving adapter per instance (it owns one notify list), any number of senders."""

    max_batch = 64
    signals_puts = True

    def __init__(
        self,
        client: redis.Redis,
        *,
        ttl_s: int = keys.CHUNK_TTL_S,
        prefix: str = "",
        max_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES,
        retry: Backoff = PUT_RETRY,
        owns_client: bool = False,
    ) -> None:
        if ttl_s <= 0:
            raise ConfigError(f"RedisConnector ttl_s must be > 0 (chunks must expire), got {ttl_s}")
        if client.get_connection_kwargs().get("decode_responses"):
            raise ConfigError("RedisConnector needs a client with decode_responses=False")
        self.client = client
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.retry = retry
        self._owns_client = owns_client
        """`close()` closes the client too (one made for this connector)."""
        self._cluster = is_cluster(client)
        self.notify_key = keys.receiver_notify_key(uuid.uuid4().hex, prefix)
        self._sender = WakeupSender(prefix, ttl_s)
        self._inbox = WakeupInbox()
        self._waiter = NotifyWaiter(client, self.notify_key)
        self._held = None if self._cluster else HeldPuts(client.connection_pool)
        self._fresh = False
        """The last `fetch` read the notify list: a zero-timeout wait needs no round trip."""

    @classmethod
    def from_url(cls, url: str, *, cluster: bool = False, **kwargs: Any) -> RedisConnector:
        """Connect to `url` (`redis://`, `rediss://`, `unix://`; ACL user/password in the URL),
        through `clients.sync_client` (`cluster`: a Redis Cluster client).

        The connection does not retry itself: `retry` is the one put policy. The connector
        owns the client and `close()` closes it."""
        own = {k: kwargs.pop(k) for k in ("ttl_s", "prefix", "max_bytes", "retry") if k in kwargs}
        kwargs.setdefault("retry", Retry(NoBackoff(), 0))
        client = sync_client(url, cluster=cluster, **kwargs)
        with contextlib.ExitStack() as unless_made:  # the client made here is closed
            unless_made.callback(client.close)
            connector = cls(client, **own, owns_client=True)
            unless_made.pop_all()
        return connector

    # --- SPEC connector -----------------------------------------------------------

    def put(self, key: str, obj: Any) -> None:
        """SET with the TTL (and a wake-up if someone listens); `CodecError` if unencodable."""
        name = stored_chunk_key(key, self.prefix)
        self._store([(name, self._encode(name, obj), keys.route_of_chunk_key(key), key)], False)

    def get(self, key: str) -> Any | None:
        """GETDEL and decode; `None` when absent."""
        name = stored_chunk_key(key, self.prefix)
        try:
            raw = self.client.getdel(name)
        except RedisError as e:
            raise TransportError(f"GETDEL {name!r} failed: {e}") from e
        return None if raw is None else self._decode(name, cast(bytes, raw))

    # --- ChunkTransport -----------------------------------------------------------

    def put_batch(self, items: Sequence[PutItem]) -> None:
        """All or nothing (MULTI/EXEC); items that cannot be encoded stop it before any I/O."""
        encoded: list[Encoded] = []
        rejected: dict[str, str] = {}
        for key, value, _last in items:
            name = stored_chunk_key(key, self.prefix)
            try:
                encoded.append((name, self._encode(name, value), keys.route_of_chunk_key(key), key))
            except CodecError as e:
                rejected[key] = str(e)
        if rejected:
            raise ChunkRejected(rejected)
        self._store(encoded, len(encoded) > 1 and not self._cluster)
        self._sender.forget(keys.route_of_chunk_key(key) for key, _v, last in items if last)

    def fetch(self, keys: Sequence[str]) -> list[Fetched]:
        """Inline values first; the rest in one MULTI: owed UNLINKs, MGET, UNLINK of what
        was read (exactly GETDEL), and the wake-ups queued meanwhile (on a cluster, the
        same in one pipeline of per-key UNLINKs and GETDELs)."""
        raws: dict[str, bytes | None] = dict(self._inbox.serve(keys))
        missing = [k for k in keys if k not in raws]
        if missing:
            owed = list(self._inbox.unlink)
            names = self._names(missing)
            per_key = self._cluster
            try:
                try:
                    replies = self._read_round(self._names(owed), names, per_key)
                except OutOfMemoryError:  # Redis full refuses all of a MULTI, reads too:
                    per_key = True  # per-key GETDELs, which it runs (and which free memory)
                    replies = self._read_round(self._names(owed), names, per_key)
            except RedisError as e:
                raise TransportError(f"MGET of {len(missing)} key(s) failed: {e}") from e
            self._inbox.paid(owed)
            fetched = replies[-1 - len(missing) : -1] if per_key else replies[-3]
            raws.update(zip(missing, fetched, strict=True))
            self._inbox.read(k for k, raw in zip(missing, fetched, strict=True) if raw is not None)
            self._inbox.take(replies[-1] or [])
            self._fresh = True
        return [self._fetched(k, raws[k]) for k in keys]

    def _read_round(self, owed: list[str], missing: list[str], per_key: bool) -> list[Any]:
        """One round trip: owed UNLINKs, the reads, the wake-ups queued meanwhile."""
        with self.client.pipeline(transaction=not per_key) as pipe:
            if per_key:  # one slot per command (a cluster): per-key deletes, GETDELs
                for name in owed:
                    pipe.unlink(name)
                for name in missing:
                    pipe.getdel(name)
            else:
                if owed:
                    pipe.unlink(*owed)
                pipe.mget(missing)
                pipe.unlink(*missing)
            pipe.lpop(self.notify_key, WAKEUP_BATCH)
            return list(pipe.execute())

    def discard(self, keys: Sequence[str]) -> int:
        """UNLINK whichever exist, in one command (any thread: the inbox is not touched)."""
        if not keys:
            return 0
        try:
            # A cluster client splits a multi-key UNLINK by slot itself.
            return int(self.client.unlink(*(stored_chunk_key(k, self.prefix) for k in keys)))
        except RedisError as e:
            raise TransportError(f"UNLINK of {len(keys)} key(s) failed: {e}") from e

    def subscribe(self, route_ids: Sequence[str]) -> None:
        """Point these routes' keys at our notify list, for the chunk TTL."""
        if not route_ids:
            return
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for route_id in route_ids:
                    route_key = keys.chunk_route_key(route_id, self.prefix)
                    pipe.set(route_key, self.notify_key, ex=self.ttl_s)
                pipe.execute()
        except RedisError as e:
            raise TransportError(f"subscribing {len(route_ids)} route(s) failed: {e}") from e

    def unsubscribe(self, route_ids: Sequence[str]) -> None:
        if not route_ids:
            return
        try:
            self.client.unlink(*(keys.chunk_route_key(r, self.prefix) for r in route_ids))
        except RedisError as e:
            raise TransportError(f"unsubscribing {len(route_ids)} route(s) failed: {e}") from e

    def wait_for_puts(self, timeout_s: float) -> dict[str, int]:
        """Read the notify list, waiting up to `timeout_s`: no round trip for a zero wait
        when `fetch` just read the list or the BLPOP in flight can be polled. Owed deletes
        ride the packet that starts a BLPOP (alone on a cluster, or past `OWED_MAX`)."""
        fresh, self._fresh = self._fresh, False
        if self._inbox.woken:
            return self._inbox.take_woken()
        owed = list(self._inbox.unlink)
        if timeout_s <= 0 and len(owed) < OWED_MAX:
            if fresh:
                return {}
            owed = [] if self._cluster else owed
        try:
            if owed and (self._cluster or len(owed) >= OWED_MAX):
                self.client.unlink(*self._names(owed))
                self._inbox.paid(owed)
                owed = []
            end = time.monotonic() + timeout_s
            while True:
                left_s = max(0.0, end - time.monotonic())
                elements, kicked, sent = self._waiter.wait(left_s, self._names(owed))
                if sent:
                    self._inbox.paid(owed)
                    owed = []
                self._inbox.take(elements)
                if self._inbox.woken or kicked or time.monotonic() >= end:
                    break
        except RedisError as e:
            raise TransportError(f"waiting for chunk wake-ups failed: {e}") from e
        return self._inbox.take_woken()

    def wake(self) -> None:
        self._waiter.kick()

    def close(self) -> None:
        """Drop the waiting connection; close the client if `from_url` created it."""
        self._waiter.close()
        if self._held is not None:
            self._held.close()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> RedisConnector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------

    def _store(self, encoded: list[Encoded], transaction: bool) -> None:
        backoff: Backoff | None = None  # made on a first failure: most puts never fail
        while True:
            try:
                pipe = put_pipe(self.client, transaction, self._cluster, self._held)
                for name, value, _route, _key in encoded:
                    pipe.set(name, value, ex=self.ttl_s)
                if self._cluster:  # the SETs land first (see the module's docstring)
                    pipe.execute()
                    pipe = put_pipe(self.client, False, True)
                unknown = self._sender.queue(pipe, encoded)
                replies = pipe.execute()
                self._sender.wake_found(self.client, encoded, unknown, replies)
                return
            except RedisError as e:
                backoff = backoff or dataclasses.replace(self.retry, failures=0)
                delay_s = backoff.failed()
                if delay_s is None:
                    raise TransportError(
                        f"SET of {len(encoded)} chunk(s) ({encoded[0][0]!r} ...) failed "
                        f"after {backoff.failures} attempt(s): {e}"
                    ) from e
                log.warning("SET %r failed (%s); retry in %.3f s", encoded[0][0], e, delay_s)
                time.sleep(delay_s)

    def _encode(self, name: str, obj: Any) -> bytes:
        """A chunk whose data is encoded already (`msgspec.Raw`: a worker's, the bytes of
        its output's data) is written around those bytes; anything else by `codec.encode`."""
        if type(obj) is dict and type(obj.get("data")) is msgspec.Raw:
            data = codec.encode_decoded(obj)
        else:
            data = codec.encode(obj)
        if len(data) > self.max_bytes:
            raise CodecError(f"{name}: {len(data)} bytes exceed the limit of {self.max_bytes}")
        return data

    def _names(self, chunk_keys: Sequence[str]) -> list[str]:
        """Redis names of bare chunk keys."""
        return [stored_chunk_key(k, self.prefix) for k in chunk_keys]

    def _fetched(self, key: str, raw: bytes | None) -> Fetched:
        if raw is None:
            return None
        try:
            return codec.decode(raw, max_bytes=self.max_bytes)
        except CodecError as e:
            name = stored_chunk_key(key, self.prefix)  # named only here: off the hot path
            log.error("malformed value under %r (%d bytes) dropped: %s", name, len(raw), e)
            return MalformedChunk(name, str(e))

    def _decode(self, name: str, raw: bytes) -> Any:
        try:
            return codec.decode(raw, max_bytes=self.max_bytes)
        except CodecError as e:
            log.error("malformed value under %r (%d bytes) dropped: %s", name, len(raw), e)
            raise
