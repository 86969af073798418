"""Redis connector: the ChunkAdapter's data plane over plain keys (SPEC §5).

`put` is `SET <prefix><key> <msgpack> EX <ttl_s>` and `get` is `GETDEL`, so a
chunk is read at most once and a chunk nobody reads expires. Keys handed in are
the bare `<req>_<stage>_<id>` strings; the namespace prefix is applied here.

Errors, by class (`omni_runtime.errors`):
* `TransportError` — Redis failed. `put` retries first (`put_retries` more
  attempts, exponential backoff from `retry_backoff_s`); `get`, `get_many` and
  `delete_many` do not (the receiver polls again anyway, and retrying a GETDEL
  whose reply was lost cannot bring the value back).
* `CodecError` — a stored value is not a valid message. It is logged and counted
  in `malformed`, and raised: the value is already consumed, and the caller
  decides whether that fails the request or is skipped. `None` keeps meaning
  only "not there yet".
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.exceptions import RedisError
from redis.retry import Retry

from omni_runtime import codec, keys
from omni_runtime.chunks.redis_wakeups import WakeupListener, WakeupSender
from omni_runtime.core.types import MalformedChunk
from omni_runtime.errors import CodecError, ConfigError, TransportError

log = logging.getLogger(__name__)

_PACKER_BUFFER_CUTOFF = 6000
"""Arguments above this size are sent as separate buffers (redis-py's own cutoff)."""


class RedisConnector:
    """`put` / consume-once `get` on one sync `redis.Redis`; thread-safe like the client."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        ttl_s: int = keys.CHUNK_TTL_S,
        prefix: str = "",
        put_retries: int = 3,
        retry_backoff_s: float = 0.01,
    ) -> None:
        if ttl_s <= 0:
            raise ConfigError(f"RedisConnector ttl_s must be > 0 (chunks must expire), got {ttl_s}")
        if put_retries < 0 or retry_backoff_s < 0:
            raise ConfigError(
                "RedisConnector put_retries and retry_backoff_s must be >= 0, "
                f"got {put_retries} and {retry_backoff_s}"
            )
        if client.get_connection_kwargs().get("decode_responses"):
            raise ConfigError("RedisConnector needs a client with decode_responses=False")
        self.client = client
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.put_retries = put_retries
        self.retry_backoff_s = retry_backoff_s
        self.malformed = 0
        self._malformed_lock = threading.Lock()
        self._owns_client = False
        self.notify_key = keys.receiver_notify_key(uuid.uuid4().hex, prefix)
        self._lock = threading.Lock()
        self._unsent_deletes: list[str] = []
        self._wakeup_sender = WakeupSender(prefix, ttl_s)
        self._wakeup_listener = WakeupListener(client, self.notify_key, prefix)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        ttl_s: int = keys.CHUNK_TTL_S,
        prefix: str = "",
        put_retries: int = 3,
        retry_backoff_s: float = 0.01,
        **redis_kwargs: Any,
    ) -> RedisConnector:
        """Connect to `url` (`redis://`, `rediss://`, `unix://`; ACL user/password in the URL).

        The client's pool packs commands with redis-py's Python packer instead of
        hiredis's: `hiredis.pack_command` copies every argument into a fresh
        mmap'd buffer and is ~5x slower for MiB-size values (research §0.2).
        The connection itself does not retry (`retry` defaults to none here), so
        `put_retries` is the one retry policy. `redis_kwargs` go to the pool;
        the connector owns the client and `close()` closes it.
        """
        redis_kwargs.setdefault("retry", Retry(NoBackoff(), 0))
        pool = redis.ConnectionPool.from_url(url, **redis_kwargs)
        # The packer must encode str arguments like the connections would (URL `encoding=`),
        # so it is built from the pool's own encoder. The pool hands the one packer object to
        # every connection it makes (`command_packer` kwarg); it keeps no state, so that is safe.
        packer = PythonRespSerializer(_PACKER_BUFFER_CUTOFF, pool.get_encoder().encode)
        pool.connection_kwargs["command_packer"] = packer
        client = redis.Redis.from_pool(pool)
        try:
            connector = cls(
                client,
                ttl_s=ttl_s,
                prefix=prefix,
                put_retries=put_retries,
                retry_backoff_s=retry_backoff_s,
            )
        except BaseException:
            client.close()
            raise
        connector._owns_client = True
        return connector

    # --- the Connector protocol -------------------------------------------------

    def put(self, key: str, obj: Any) -> None:
        """Store `obj` under `prefix + key` with the TTL, and wake the receiver if it listens.

        Raises `TransportError` after `put_retries` retries. The wake-up rides in
        the same round trip as the SET once the receiver's route is known.
        """
        self.put_many([(key, obj)], transaction=False)

    def put_many(self, items: Sequence[tuple[str, Any]], transaction: bool = True) -> None:
        """Put every item in one round trip, all or nothing (MULTI/EXEC): a sender may
        advance its chunk ids for all of them, or for none."""
        encoded = [
            (self.prefix + key, codec.encode(obj), key.rsplit("_", 1)[0]) for key, obj in items
        ]
        attempt = 0
        while True:
            try:
                self._set_and_notify(encoded, transaction)
                break
            except RedisError as e:
                if attempt >= self.put_retries:
                    raise TransportError(
                        f"SET of {len(encoded)} chunk(s) ({encoded[0][0]!r} ...) failed "
                        f"after {attempt + 1} attempt(s): {e}"
                    ) from e
                delay_s = self.retry_backoff_s * 2**attempt
                attempt += 1
                log.warning(
                    "SET %r failed (%s); retry %d/%d in %.3f s",
                    encoded[0][0],
                    e,
                    attempt,
                    self.put_retries,
                    delay_s,
                )
                time.sleep(delay_s)
        finished = {
            key.rsplit("_", 1)[0]
            for key, obj in items
            if isinstance(obj, dict) and obj.get("finished") is True
        }
        if finished:
            self._wakeup_sender.forget(finished)

    def _set_and_notify(self, encoded: list[tuple[str, bytes, str]], transaction: bool) -> None:
        with self.client.pipeline(transaction=transaction) as pipe:
            for name, value, _route_id in encoded:
                pipe.set(name, value, ex=self.ttl_s)
            unknown = self._wakeup_sender.queue(pipe, encoded)
            replies = pipe.execute()
        self._wakeup_sender.wake_found(self.client, encoded, unknown, replies)

    def get(self, key: str) -> Any | None:
        """GETDEL `prefix + key` and decode it; `None` when absent."""
        name = self.prefix + key
        try:
            raw = self.client.getdel(name)
        except RedisError as e:
            raise TransportError(f"GETDEL {name!r} failed: {e}") from e
        if raw is None:
            return None
        return self._decode(name, raw)

    # --- batch operations ---------------------------------------------------------

    def get_many(self, keys: Sequence[str]) -> list[Any | None]:
        """GETDEL every key in one round trip (non-transactional pipeline).

        The result is aligned with `keys`. If any value is malformed, every
        value is still consumed and stands as a `MalformedChunk` in its slot, so
        the good values of the same round trip are not lost.
        """
        if not keys:
            return []
        names = [self.prefix + key for key in keys]
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.getdel(name)
                raws: list[bytes | None] = pipe.execute()
        except RedisError as e:
            raise TransportError(f"pipelined GETDEL of {len(names)} key(s) failed: {e}") from e
        return self._decode_all(names, raws)

    def peek_many(self, keys: Sequence[str], delete_first: Sequence[str] = ()) -> list[Any | None]:
        """MGET: read without consuming, so a reader can look ahead and delete what it keeps.

        One command for any number of keys: a round over 1,000 idle requests
        costs one reply array, not 1,000 pipelined replies. `delete_first`
        (keys consumed last round) are unlinked in the same round trip.
        """
        names = [self.prefix + key for key in keys]
        deleted = [self.prefix + key for key in delete_first]
        with self._lock:
            inline = self._wakeup_listener.take_inline(names, deleted)
            self._unsent_deletes.extend(deleted)
            missing = [n for n in names if n not in inline]
            deletes = self._unsent_deletes if missing else []
            if missing:
                self._unsent_deletes = []
        raws: list[bytes | str | None] = [inline.get(n) for n in names]
        if missing:  # what the wake-ups did not carry comes from Redis, deletes ride along
            try:
                with self.client.pipeline(transaction=False) as pipe:
                    if deletes:
                        pipe.unlink(*deletes)
                    pipe.mget(missing)
                    fetched = dict(zip(missing, pipe.execute()[-1], strict=True))
            except RedisError as e:
                with self._lock:
                    self._unsent_deletes.extend(deletes)
                raise TransportError(f"MGET of {len(missing)} key(s) failed: {e}") from e
            raws = [inline[n] if n in inline else fetched[n] for n in names]
        return self._decode_all(names, raws)

    # --- wake-ups: a receiver blocks instead of polling ------------------------------

    def listen(self, route_ids: Sequence[str]) -> None:
        """Ask senders of these `<req>_<stage>` routes to wake this connector after each put."""
        self._wakeup_listener.listen(route_ids, self.ttl_s)

    def unlisten(self, route_ids: Sequence[str]) -> None:
        if route_ids:
            self.delete_many([f"route:{route_id}" for route_id in route_ids])

    def on_put(self, callback: Callable[[str], None]) -> None:
        """Call `callback(<req>_<stage>)` (on a listener thread) for each put we listen to."""
        self._wakeup_listener.on_put(callback)

    def deletes_pending(self) -> bool:
        """Whether `peek_many` holds deletes back (all it read came inline): flush with
        `delete_many([])`."""
        with self._lock:
            return bool(self._unsent_deletes)

    def delete_many(self, keys: Iterable[str]) -> None:
        """UNLINK every listed key (and deletes `peek_many` could not send yet) in one command."""
        with self._lock:
            names = [*self._unsent_deletes, *(self.prefix + key for key in keys)]
            self._unsent_deletes = []
            self._wakeup_listener.mark_consumed(names)
        if not names:
            return
        try:
            self.client.unlink(*names)
        except RedisError as e:
            raise TransportError(f"UNLINK of {len(names)} key(s) failed: {e}") from e

    # --- lifecycle ------------------------------------------------------------------

    def close(self) -> None:
        """Stop the wake-up listener; close the client if `from_url` created it."""
        self._wakeup_listener.close()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> RedisConnector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _decode_all(self, names: list[str], raws: Sequence[bytes | str | None]) -> list[Any | None]:
        """Decoded values aligned with `names`; a bad one becomes a `MalformedChunk` in its slot
        (it was consumed with the others, which must not be lost with it)."""
        results: list[Any | None] = []
        for name, raw in zip(names, raws, strict=True):
            if raw is None:
                results.append(None)
                continue
            try:
                results.append(self._decode(name, raw))
            except CodecError as e:
                results.append(MalformedChunk(name, str(e)))
        return results

    def _decode(self, name: str, raw: bytes | str) -> Any:
        try:
            if not isinstance(raw, bytes):  # only a decode_responses client returns str
                raise CodecError(f"expected bytes from Redis, got {type(raw).__name__}")
            return codec.decode(raw)
        except CodecError as e:
            with self._malformed_lock:
                self.malformed += 1
            log.error("malformed value under %r (%d bytes) dropped: %s", name, len(raw), e)
            raise
