"""One XREADGROUP for several streams that one consumer of one group reads.

An orchestrator slot reads every stage's output stream under the same consumer name.
Read one by one, each stream costs a blocked read, a round trip and a wake-up per
batch; with several orchestrators each batch is smaller, so that cost per request
grows. A joint read asks for all of them at once: whichever member reader finds
nothing waiting for it sends the next read, and the others wait for that one; the
entries it brings are shared out to their streams' readers, in each stream's order.

Each member keeps what makes it a reader of its own stream: its backlog cursor (one
stream can walk its pending backlog while the others read new entries), its
validation and dead letters, its acknowledgements. A Redis Cluster cannot read
streams of several slots in one command, so there each stream is read alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from omni_runtime.redis_io.entries import BacklogCursor, Entry, no_group
from omni_runtime.redis_io.interrupt import ReadInterrupt, ReadInterrupted
from omni_runtime.redis_io.raw_reads import AsyncHeldReads

log = logging.getLogger(__name__)


class Member(Protocol):
    """What a joint read needs of a stream's reader (`streams.GroupReader`)."""

    stream: str
    group: str
    consumer: str
    cursor: BacklogCursor

    def took(self, entries: list[Entry]) -> list[Entry]: ...

    def read_failed(self, e: RedisError) -> float: ...

    async def make_group(self) -> None: ...


class JointRead:
    """Reads the streams of its members (`GroupReader`s of one group and consumer) at once."""

    def __init__(
        self,
        client: aioredis.Redis,
        group: str,
        consumer: str,
        block_budget: Callable[[], int] | None = None,
    ) -> None:
        self.client, self.group, self.consumer = client, group, consumer
        self.block_budget = block_budget
        self.members: dict[bytes, Member] = {}
        self._waiting: dict[bytes, list[Entry]] = {}
        """stream → entries read for its member and not yet taken."""
        self._interrupt = ReadInterrupt()
        self._reads = AsyncHeldReads(client)
        self._read_done: asyncio.Event | None = None
        """Set when the read in progress ends; None while none is."""
        self._brought = False
        """The last read brought entries, and no read was started since."""

    def add(self, reader: Member) -> None:
        if (reader.group, reader.consumer) != (self.group, self.consumer):
            raise ValueError(f"{reader.stream} is read by another group or consumer")
        self.members[reader.stream.encode()] = reader
        self._waiting[reader.stream.encode()] = []

    @property
    def interrupted(self) -> bool:
        return self._interrupt.interrupted

    @property
    def reading(self) -> bool:
        """A read is in progress (a blocking one: waiting for entries)."""
        return self._interrupt.running

    def interrupt(self) -> None:
        """Cut the read in progress short, and every later one (see `GroupReader.interrupt`)."""
        self._interrupt.interrupt()
        for reader in self.members.values():
            reader.cursor = BacklogCursor(True)

    async def fetch(self, reader: Member, count: int, block_ms: int) -> list[Entry]:
        """The entries read for `reader`'s stream: those waiting, else what the next read
        (its own, or the one in progress) brings for it, maybe none; `[]` once interrupted.

        Like a lone reader's, each call is at most one read, so its caller checks its stop
        flag and lease fence between reads (a read never blocks past the fence)."""
        name = reader.stream.encode()
        if not self._waiting[name] and self._brought:
            await self._let_handle()
        if not self._waiting[name] and not self.interrupted:
            done = self._read_done
            if done is not None:  # another member is reading: its entries may be ours
                await done.wait()
            else:
                self._read_done = done = asyncio.Event()
                self._brought = False
                try:
                    await self._read(count, block_ms)
                finally:
                    self._read_done = None
                    done.set()
        entries, self._waiting[name] = self._waiting[name], []
        return entries

    async def _let_handle(self) -> None:
        """Before a next read is packed and sent, what the last one brought is handled:
        its members take their entries (bounded: a member may have stopped reading), then
        what they handed on (the dispatcher's routing) runs. Sent first, that read held a
        light-load hop's routing back (docs/architecture.md gives the figures)."""
        for _ in self.members:
            if not any(self._waiting.values()):
                break
            await asyncio.sleep(0)
        await asyncio.sleep(0)

    async def _read(self, count: int, block_ms: int) -> None:
        if self.block_budget is not None:
            block_ms = self.block_budget()
        streams: dict[Any, Any] = {name: r.cursor.next_id for name, r in self.members.items()}
        try:
            reply = await self._interrupt.run(lambda: self._xreadgroup(streams, count, block_ms))
        except ReadInterrupted:
            return
        except ResponseError as e:
            if not no_group(e):  # (none is expected: a bug, not an outage)
                raise
            await self._regroup(streams)
            return
        except RedisError as e:
            await self._failed(e)
            return
        got = dict(reply)
        self._brought = bool(got)
        for name, reader in self.members.items():
            entries = got.get(name, [])
            if entries or reader.cursor.in_backlog:
                self._waiting[name].extend(reader.took(entries))

    async def _regroup(self, streams: dict[Any, Any]) -> None:
        """The group vanished (Redis came back empty): made again on every stream."""
        log.warning("group %s of %s vanished; recreating it", self.group, list(streams))
        try:
            for reader in self.members.values():
                await reader.make_group()
        except RedisError as e:  # Redis went away again meanwhile: a failed read
            await self._failed(e)

    async def _failed(self, e: RedisError) -> None:
        """Every member's cursor back to its backlog, and the read back-off waited out."""
        await asyncio.sleep(max(reader.read_failed(e) for reader in self.members.values()))

    async def _xreadgroup(
        self, streams: dict[bytes, str], count: int, block_ms: int
    ) -> list[tuple[bytes, list[Entry]]]:
        args = ("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count, "BLOCK", block_ms)
        return await self._reads.read(args, streams)
