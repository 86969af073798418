"""Reading the control plane: one consumer-group reader, strict entries, one dead-letter path.

A malformed entry is logged, counted, dead-lettered and acknowledged, never handed
to the caller and never fatal (SPEC §5). The async flavour serves the orchestrator and
clients, the sync one the worker's threads; both share `entries` and `dead_letters`.
API (stable):

* `GroupReader(client, stream, group, consumer, model, *, max_bytes, dead_letters,
  metrics=None, backoff=None, backlog_first=True, block_budget=None)` over a
  `redis.asyncio` client (`block_budget`: a callable, ms, overriding each read's block);
  `SyncGroupReader(...)`, the same over a `redis.Redis`, also takes `stop=` (a
  `threading.Event` that cuts a back-off wait short). `model`: a pydantic model class
  or a `TypeAdapter`; `dead_letters`: `Names.dead_letters`; `backoff`: the policy
  (`RetrySettings.backoff(bounded=True)`): reads retry forever, writes `max_attempts` times.
  - `[await] read(count, block_ms) -> list[(entry_id: bytes, msg)]`: this consumer's
    own pending backlog from id 0 first (what a previous run read but never
    acknowledged), then new entries with `>`; after a failed read the backlog again
    (a reply lost with its connection left its entries pending). `[]` on timeout, or
    after a failed XREADGROUP once its back-off delay passed, so callers loop and check
    their stop flag. A vanished group is recreated. `read_ns`: monotonic ns of the last reply.
  - `interrupt()` (async flavour): shutdown cuts the blocking read in progress short
    (`interrupt.ReadInterrupt`); what it was delivered stays pending, read again.
    On a single server it reads through a `joint_read.JointRead`: its own, or `joint=`,
    one shared with other streams of its group and consumer.
  - `[await] accept(entries) -> list[(entry_id, msg)]`: the same checks for entries
    obtained otherwise (XCLAIM): malformed ones dead-lettered, trimmed ones acked.
  - `[await] ack(*entry_ids) -> bool`: XACK, bounded retries; False once given up.
* `DeadLetters(client, dead_stream, *, metrics=None, backoff=None)` / `SyncDeadLetters`:
  `[await] send(stream, group, entry_id, error, fields) -> bool` XADDs to `dead_stream`
  (MAXLEN ~ `keys.DEAD_LETTER_MAXLEN`) and XACKs the entry, in one pipeline.
* `ensure_group(client, stream, group)` / `ensure_group_sync(...)`: create the group
  from id 0 (entries written before it existed are read); BUSYGROUP is fine.
* Re-exported from `entries`: `Entry`, `entry_fields`, `stream_reply`, `parse_entry`,
  `dead_letter_fields`, `BacklogCursor`.

Counters (`omni_runtime.observe.metrics`, labelled by `stream`): `omni_malformed_entries_total`,
`omni_dead_letters_total`, `omni_retries_total`, `omni_dropped_writes_total`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Generic, TypeVar

import redis
import redis.asyncio as aioredis
from pydantic import TypeAdapter
from redis.exceptions import RedisError, ResponseError

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised
from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.clients import is_cluster
from omni_runtime.redis_io.dead_letters import (
    DEFAULT_BACKOFF,
    BadEntry,
    DeadLetters,
    SyncDeadLetters,
)
from omni_runtime.redis_io.entries import (
    BacklogCursor,
    Entry,
    SortedEntries,
    dead_letter_fields,
    entry_fields,
    no_group,
    parse_entry,
    stream_reply,
)
from omni_runtime.redis_io.interrupt import ReadInterrupt, ReadInterrupted
from omni_runtime.redis_io.joint_read import JointRead
from omni_runtime.redis_io.raw_reads import xreadgroup_sync

__all__ = [
    "BacklogCursor",
    "BadEntry",
    "DeadLetters",
    "Entry",
    "GroupReader",
    "SyncDeadLetters",
    "SyncGroupReader",
    "dead_letter_fields",
    "ensure_group",
    "ensure_group_sync",
    "entry_fields",
    "parse_entry",
    "stream_reply",
]

log = logging.getLogger(__name__)

M = TypeVar("M")


def ensure_group_sync(client: redis.Redis, stream: str, group: str) -> None:
    """Create the group from id 0 so entries written before it existed are still read."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """`ensure_group_sync` for the event loop."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


class _ReaderBase(Generic[M]):
    """State both flavours share: names, validator, cursor, read back-off, counters."""

    def __init__(
        self,
        stream: str,
        group: str,
        consumer: str,
        model: type[M] | TypeAdapter[M],
        max_bytes: int,
        metrics: Metrics | None,
        backoff: Backoff | None,
        backlog_first: bool,
        batches: bool = False,
        on_bad: Callable[[Sequence[BadEntry]], None] | None = None,
    ) -> None:
        self.stream, self.group, self.consumer = stream, group, consumer
        self.max_bytes = max_bytes
        self.metrics = metrics or Metrics()
        self.cursor = BacklogCursor(backlog_first)
        self.read_ns = 0
        self.batches = batches
        """Entries may carry several messages (a stage's outputs)."""
        self.on_bad = on_bad
        """Told of each read's malformed entries (as they are dead-lettered): a reader's
        owner may answer whoever sent them."""
        self._model = model
        self._read_policy = replace(backoff or DEFAULT_BACKOFF, failures=0, max_attempts=None)

    def read_failed(self, e: RedisError) -> float:
        # The failed XREADGROUP may have been executed and only its reply lost: those
        # entries are now pending for this consumer and `>` never returns them again.
        self.cursor = BacklogCursor(True)
        delay = self._read_policy.failed() or 0.0
        log.warning("reading %s failed, retrying in %.2fs: %r", self.stream, delay, e)
        self.metrics.inc("omni_retries_total", stream=self.stream)
        return delay

    def took(self, entries: list[Entry]) -> list[Entry]:
        """A read of this stream returned `entries`: the cursor moves on."""
        self._read_policy.succeeded()
        self.read_ns = time.monotonic_ns()
        self.cursor.advance(entries)
        return entries

    def _sort(self, entries: Sequence[Entry]) -> SortedEntries[M]:
        batch = SortedEntries(entries, self._model, self.max_bytes, self.batches)
        if batch.bad:
            self.metrics.inc("omni_malformed_entries_total", len(batch.bad), stream=self.stream)
            if self.on_bad is not None:  # handed in; the answer is a courtesy: the entries go
                answered = foreign.call(self.on_bad, batch.bad)  # dead all the same
                if isinstance(answered, Raised):
                    log.error(
                        "answering malformed entries of %s failed",
                        self.stream,
                        exc_info=answered.error,
                    )
        return batch


class SyncGroupReader(_ReaderBase[M]):
    """A consumer in a group, for a thread: strict entries, backlog first, bad ones dead."""

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        model: type[M] | TypeAdapter[M],
        *,
        max_bytes: int,
        dead_letters: str,
        metrics: Metrics | None = None,
        backoff: Backoff | None = None,
        backlog_first: bool = True,
        stop: threading.Event | None = None,
    ) -> None:
        super().__init__(stream, group, consumer, model, max_bytes, metrics, backoff, backlog_first)
        self.client = client
        self._stop = stop or threading.Event()
        self._dead = SyncDeadLetters(client, dead_letters, metrics=self.metrics, backoff=backoff)

    def read(self, count: int, block_ms: int) -> list[tuple[bytes, M]]:
        walking = self.cursor.in_backlog
        entries = self._fetch(count, block_ms)
        if walking and entries == [] and not self.cursor.in_backlog:
            entries = self._fetch(count, block_ms)  # backlog done: the new entries now
        return self.accept(entries) if entries else []

    def _fetch(self, count: int, block_ms: int) -> list[Entry] | None:
        try:
            streams = {self.stream: self.cursor.next_id}
            reply = xreadgroup_sync(
                self.client, self.group, self.consumer, streams, count, block_ms
            )
        except ResponseError as e:
            if not no_group(e):
                raise
            log.warning("group %s of %s vanished; recreating it", self.group, self.stream)
            try:
                ensure_group_sync(self.client, self.stream, self.group)
            except RedisError as again:  # Redis went away again meanwhile: a failed read
                self._stop.wait(self.read_failed(again))
            return None
        except RedisError as e:
            self._stop.wait(self.read_failed(e))
            return None
        return self.took([entry for _s, batch in reply for entry in batch])

    def accept(self, entries: Sequence[Entry]) -> list[tuple[bytes, M]]:
        batch = self._sort(entries)
        if batch.bad:
            self._dead.send_all(self.stream, self.group, batch.bad)
        if batch.trimmed:
            self.ack(*batch.trimmed)
        return batch.good

    def ack(self, *entry_ids: bytes) -> bool:
        if not entry_ids:
            return True
        op = lambda: self.client.xack(self.stream, self.group, *entry_ids)  # noqa: E731
        return self._dead.retry_sync(op, "acknowledging", self.stream)


class GroupReader(_ReaderBase[M]):
    """`SyncGroupReader` for the event loop."""

    def __init__(
        self,
        client: aioredis.Redis,
        stream: str,
        group: str,
        consumer: str,
        model: type[M] | TypeAdapter[M],
        *,
        max_bytes: int,
        dead_letters: str,
        metrics: Metrics | None = None,
        backoff: Backoff | None = None,
        backlog_first: bool = True,
        block_budget: Callable[[], int] | None = None,
        batches: bool = False,
        on_bad: Callable[[Sequence[BadEntry]], None] | None = None,
        joint: JointRead | None = None,
    ) -> None:
        super().__init__(
            stream,
            group,
            consumer,
            model,
            max_bytes,
            metrics,
            backoff,
            backlog_first,
            batches,
            on_bad,
        )
        self.client = client
        self._dead = DeadLetters(client, dead_letters, metrics=self.metrics, backoff=backoff)
        self._interrupt = ReadInterrupt()
        self.block_budget = block_budget
        if joint is None and not is_cluster(client):  # a connection of its own, packed by hand
            joint = JointRead(client, group, consumer)
        self.joint = joint
        """The read this reader's entries come through (None: a cluster's, read alone)."""
        if joint is not None:
            joint.add(self)

    @property
    def reading(self) -> bool:
        """An XREADGROUP of this reader is in progress (blocked, when nothing is new)."""
        return self._interrupt.running if self.joint is None else self.joint.reading

    @property
    def interrupted(self) -> bool:
        return self._interrupt.interrupted or (self.joint is not None and self.joint.interrupted)

    def interrupt(self) -> None:
        """Shutdown: cut the blocking read in progress short; later reads return `[]`.
        What the cut read was delivered stays pending, read again as backlog on restart.
        A member of a joint read interrupts it for every member."""
        self._interrupt.interrupt()
        self.cursor = BacklogCursor(True)
        if self.joint is not None:
            self.joint.interrupt()

    async def read(self, count: int, block_ms: int) -> list[tuple[bytes, M]]:
        block_ms = block_ms if self.block_budget is None else self.block_budget()
        walking = self.cursor.in_backlog
        entries = await self._fetch(count, block_ms)
        if walking and entries == [] and not self.cursor.in_backlog:
            entries = await self._fetch(count, block_ms)  # backlog done: the new entries now
        return await self.accept(entries) if entries else []

    async def _fetch(self, count: int, block_ms: int) -> list[Entry] | None:
        if self.joint is not None:
            return await self.joint.fetch(self, count, block_ms)
        try:
            reply: object = await self._interrupt.run(
                lambda: self.client.xreadgroup(
                    self.group, self.consumer, {self.stream: self.cursor.next_id}, count, block_ms
                )
            )
        except ReadInterrupted:
            return None
        except ResponseError as e:
            if not no_group(e):
                raise
            log.warning("group %s of %s vanished; recreating it", self.group, self.stream)
            try:
                await self.make_group()
            except RedisError as again:  # Redis went away again meanwhile: a failed read
                await asyncio.sleep(self.read_failed(again))
            return None
        except RedisError as e:
            await asyncio.sleep(self.read_failed(e))
            return None
        return self.took([entry for _s, batch in stream_reply(reply) for entry in batch])

    async def make_group(self) -> None:
        """Make the group anew (it vanished with its stream): `ensure_group`."""
        await ensure_group(self.client, self.stream, self.group)

    async def accept(self, entries: Sequence[Entry]) -> list[tuple[bytes, M]]:
        batch = self._sort(entries)
        if batch.bad:
            await self._dead.send_all(self.stream, self.group, batch.bad)
        if batch.trimmed:
            await self.ack(*batch.trimmed)
        return batch.good

    async def ack(self, *entry_ids: bytes) -> bool:
        if not entry_ids:
            return True

        async def op() -> object:
            return await self.client.xack(self.stream, self.group, *entry_ids)

        return await self._dead.retry(op, "acknowledging", self.stream)
