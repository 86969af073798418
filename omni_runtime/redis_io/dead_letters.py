"""The one dead-letter path, and the bounded retries every control-plane write shares.

A malformed entry is moved to the dead-letter stream and acknowledged in one
pipeline (two round trips on a cluster, the copy first), so it is never lost and
never read again; the sync flavour serves worker threads, the async one the event
loop. Import from `streams`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.clients import is_cluster
from omni_runtime.redis_io.entries import dead_letter_fields

BadEntry = tuple[bytes, Mapping[bytes, bytes] | None, str]
"""(entry id, its fields, why it is malformed)."""

log = logging.getLogger(__name__)

DEFAULT_BACKOFF = Backoff(0.05, 2.0, 20)


class Retrying:
    """Bounded retries of one write, counted; the policy is copied per call (thread-safe)."""

    def __init__(self, metrics: Metrics | None, backoff: Backoff | None) -> None:
        self.metrics = metrics or Metrics()
        template = backoff or DEFAULT_BACKOFF
        self._write_policy = replace(template, failures=0, max_attempts=template.max_attempts or 20)

    def _failed(self, policy: Backoff, what: str, stream: str, e: Exception) -> float | None:
        delay = policy.failed()
        if delay is None:
            log.error(
                "giving up on %s (%s) after %d attempts: %r", what, stream, policy.failures, e
            )
            self.metrics.inc("omni_dropped_writes_total", stream=stream)
        else:
            log.warning("%s (%s) failed, retrying in %.2fs: %r", what, stream, delay, e)
            self.metrics.inc("omni_retries_total", stream=stream)
        return delay

    def retry_sync(self, op: Callable[[], object], what: str, stream: str) -> bool:
        policy = replace(self._write_policy)
        while True:
            try:
                op()
                return True
            except RedisError as e:
                if (delay := self._failed(policy, what, stream, e)) is None:
                    return False
                time.sleep(delay)

    async def retry(self, op: Callable[[], Awaitable[object]], what: str, stream: str) -> bool:
        policy = replace(self._write_policy)
        while True:
            try:
                await op()
                return True
            except RedisError as e:
                if (delay := self._failed(policy, what, stream, e)) is None:
                    return False
                await asyncio.sleep(delay)


def _queue_copies(pipe: Any, dead: str, stream: str, bad: Sequence[BadEntry]) -> None:
    for entry_id, fields, error in bad:
        fields_out = cast("dict[Any, Any]", dead_letter_fields(stream, entry_id, error, fields))
        pipe.xadd(dead, fields_out, maxlen=keys.DEAD_LETTER_MAXLEN, approximate=True)


def _queue_removals(pipe: Any, stream: str, group: str | None, bad: Sequence[BadEntry]) -> None:
    """Acknowledge (`group` None: a plain XREAD reader) and delete the originals: nobody
    can use them, and they must not hold memory until MAXLEN trims them. On a cluster,
    in a round trip after the copies' (a cluster pipeline writes its nodes in no order)."""
    ids = [entry_id for entry_id, _fields, _error in bad]
    if group is not None:
        pipe.xack(stream, group, *ids)
    pipe.xdel(stream, *ids)


class SyncDeadLetters(Retrying):
    """The dead-letter path of worker threads: XADD to the dead stream + XACK, counted."""

    def __init__(
        self,
        client: redis.Redis,
        dead_stream: str,
        *,
        metrics: Metrics | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        super().__init__(metrics, backoff)
        self.client = client
        self.dead_stream = dead_stream

    def send(
        self,
        stream: str,
        group: str | None,
        entry_id: bytes,
        error: str,
        fields: Mapping[bytes, bytes] | None,
    ) -> bool:
        return self.send_all(stream, group, [(entry_id, fields, error)])

    def send_all(self, stream: str, group: str | None, bad: Sequence[BadEntry]) -> bool:
        """Every bad entry of one read in one pipeline."""
        for entry_id, _fields, error in bad:
            log.error("entry %s of %s dead-lettered: %s", entry_id, stream, error)

        def op() -> None:
            pipe = self.client.pipeline(transaction=False)
            _queue_copies(pipe, self.dead_stream, stream, bad)
            if is_cluster(self.client):
                pipe.execute()
                pipe = self.client.pipeline(transaction=False)
            _queue_removals(pipe, stream, group, bad)
            pipe.execute()

        ok = self.retry_sync(op, "dead-lettering", stream)
        if ok:
            self.metrics.inc("omni_dead_letters_total", len(bad), stream=stream)
        return ok


class DeadLetters(Retrying):
    """`SyncDeadLetters` for the event loop."""

    def __init__(
        self,
        client: aioredis.Redis,
        dead_stream: str,
        *,
        metrics: Metrics | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        super().__init__(metrics, backoff)
        self.client = client
        self.dead_stream = dead_stream

    async def send(
        self,
        stream: str,
        group: str | None,
        entry_id: bytes,
        error: str,
        fields: Mapping[bytes, bytes] | None,
    ) -> bool:
        return await self.send_all(stream, group, [(entry_id, fields, error)])

    async def send_all(self, stream: str, group: str | None, bad: Sequence[BadEntry]) -> bool:
        """Every bad entry of one read in one pipeline: a flood costs a round trip per
        batch, not per entry."""
        for entry_id, _fields, error in bad:
            log.error("entry %s of %s dead-lettered: %s", entry_id, stream, error)

        async def op() -> None:
            pipe = self.client.pipeline(transaction=False)
            _queue_copies(pipe, self.dead_stream, stream, bad)
            if is_cluster(self.client):
                await pipe.execute()
                pipe = self.client.pipeline(transaction=False)
            _queue_removals(pipe, stream, group, bad)
            await pipe.execute()

        ok = await self.retry(op, "dead-lettering", stream)
        if ok:
            self.metrics.inc("omni_dead_letters_total", len(bad), stream=stream)
        return ok
