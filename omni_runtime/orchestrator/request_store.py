"""Durable request states: one hash per orchestrator slot, a field per request in flight.

The orchestrator marks a request dirty whenever its routing state changes; as the
writer takes its next batch it asks `ops()` for one HSET carrying every dirty
request's state and one HDEL of every request that ended: two commands per batch
however many requests it touched. The writer puts those after the stream entries
they record (stage inputs, client outputs) and before the acknowledgements they
allow, in the same pipeline, so a state never claims what Redis does not have.
Coalesced: a request changed twice between batches is written once.

The stage data a state keeps (sequential mode: every chunk of the stage running, until
it finishes and `forward_fn` has them all) is not in the state's own field: each chunk
is a field of its own in the same hash (`keys.state_chunk_field`), written in the HSET
of the batch that recorded it and never again, and the state counts them
(`stage_chunks`). A state re-encoded with all its data on every change made a stage of
N chunks cost O(N) bytes per chunk, in the orchestrator and in Redis. Chunk fields go
in the same HSET as their state and leave in the same HDEL, so a state never counts a
chunk Redis does not have (a retried HSET writes the same fields again).

Expiry: a state records its deadline; the hash expires 60 s after the latest
deadline it holds (PEXPIREAT, moved only forward), and a state whose deadline is
that long past when the slot is loaded is dropped unread, as a key of its own
with that TTL would have expired.

A request whose state cannot be written (it cannot be encoded, its deadline is out
of range) fails alone: `failed` hears of it (the orchestrator ends it with one error)
and the batch goes on without it, so no one request can stop the slot's writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import redis.asyncio as aioredis
from pydantic import ValidationError

from omni_runtime import keys
from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised
from omni_runtime.core.types import ReqState
from omni_runtime.errors import CodecError
from omni_runtime.redis_io.write_ops import ExpireAt, HashDrop, HashPut, Op
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import codec, outgoing
from omni_runtime.wire.messages import MAX_WALL_CLOCK_S, DurableRequest
from omni_runtime.wire.outgoing import DurableRequestOut

log = logging.getLogger(__name__)

GRACE_S = 60.0
"""A state outlives its request's deadline by this long (a takeover then ends it)."""

_NONE: dict[Any, Any] = {}
"""No stage data (never written to)."""

Describe = Callable[[str, ReqState], DurableRequestOut | None]
"""A request's `DurableRequest` (None: do not keep it)."""
Failed = Callable[[str, Exception], None]
"""A request whose state could not be written, and why."""


def expiry_ms(deadline_at: float) -> int:
    """When a state with this deadline may go: ms since the epoch, for PEXPIREAT.
    Raises `ValueError` for a deadline no state may carry (Redis would refuse it)."""
    if not 0 <= deadline_at <= MAX_WALL_CLOCK_S:  # NaN too
        raise ValueError(f"deadline_at {deadline_at!r} is out of range")
    return int((deadline_at + GRACE_S) * 1000)


class RequestStore:
    """One slot's durable states: dirty tracking, the writer's source, loading."""

    def __init__(
        self,
        writer: StreamWriter,
        names: keys.Names,
        slot: int,
        describe: Describe,
        enabled: bool = True,
        clock: Callable[[], float] = time.time,
        failed: Failed | None = None,
    ) -> None:
        self.writer = writer
        self.names = names
        self.slot = slot
        self.key = names.orchestrator_states(slot)
        self.describe = describe
        self.enabled = enabled
        self.clock = clock
        self.failed = failed
        self._dirty: dict[str, ReqState | None] = {}
        self._stored: set[str] = set()
        """Requests with a field in the hash."""
        self._chunks: dict[str, dict[int, int]] = {}
        """Request → stage → chunk fields in the hash (indexes 0 .. n-1)."""
        self._renewed: set[str] = set()
        """Requests that ended since the last batch: one dirty again is a new request under
        the same id, whose chunks are written anew from index 0."""
        self._expiry_ms = 0
        """The latest expiry its states need, ms since the epoch (0: none yet)."""
        self._forever = False
        """The hash was made persistent: a state in it has no deadline."""
        self._set = (0, False)
        """(`_expiry_ms`, `_forever`) as last written: the expiry is written when it moved."""
        if enabled:
            writer.sources.append(self.ops)

    def __len__(self) -> int:
        return len(self._dirty)

    def changed(self, request_id: str, state: ReqState | None) -> None:
        """`state` None: the request ended (its field goes)."""
        if self.enabled:
            self._dirty[request_id] = state
            if state is None:
                self._renewed.add(request_id)
            self.writer.wake()

    def detach(self) -> None:
        """This slot is given up: nothing more of it is written."""
        self._dirty.clear()
        self._stored.clear()
        self._chunks.clear()
        self._renewed.clear()
        if self.ops in self.writer.sources:
            self.writer.sources.remove(self.ops)

    def ops(self) -> list[Op]:
        dirty, self._dirty = self._dirty, {}
        renewed, self._renewed = self._renewed, set()
        puts: dict[str | bytes, bytes] = {}
        drops: list[str | bytes] = []
        for rid, state in dirty.items():
            doc = None if state is None else foreign.call(self.describe, rid, state)  # handed in
            if isinstance(doc, Raised):  # this request fails; the others' states are written
                self._failed(rid, doc.error)
                continue
            if doc is None:
                if rid in self._stored:  # else never written (it ended within one batch)
                    self._stored.discard(rid)
                    drops.append(rid)
                    if had := self._chunks.pop(rid, None):
                        drops.extend(_fields(rid, had, _NONE))
                continue
            kept: dict[int, list[Any]] = doc.stage_data
            had = self._chunks.get(rid, _NONE)
            new: dict[str | bytes, bytes] = _NONE
            counts: dict[int, int] = _NONE
            try:
                if kept:
                    counts = {sid: len(data) for sid, data in kept.items()}
                    new = {
                        keys.state_chunk_field(rid, sid, i): codec.encode_decoded(data[i])
                        for sid, data in kept.items()
                        for i in range(0 if rid in renewed else had.get(sid, 0), len(data))
                    }  # data as read
                doc = outgoing.replace(doc, stage_data=_NONE, stage_chunks=counts)
                until = None if doc.deadline_at is None else expiry_ms(doc.deadline_at)
                blob = outgoing.encode(doc)
            except (CodecError, ValueError) as e:  # it cannot be encoded, its deadline is out of
                # range: this request fails; the others' states are written
                self._failed(rid, e)
                self._renewed |= {rid} & renewed  # its next try still starts from index 0
                continue
            if new:
                puts.update(new)
            puts[rid] = blob
            if had:
                drops.extend(_fields(rid, had, counts))
            if counts:
                self._chunks[rid] = counts
            else:
                self._chunks.pop(rid, None)
            self._stored.add(rid)
            if until is None:
                self._forever = True
            else:
                self._expiry_ms = max(self._expiry_ms, until)
        out: list[Op] = []
        if puts:
            out.append(HashPut(self.key, puts))
        if drops:
            out.append(HashDrop(self.key, drops))
        if not self._stored:  # the hash went with its last field, and its expiry with it
            self._expiry_ms, self._forever, self._set = 0, False, (0, False)
        elif puts and self._set != (self._expiry_ms, self._forever):
            self._set = (self._expiry_ms, self._forever)
            out.append(ExpireAt(self.key, None if self._forever else self._expiry_ms))
        return out

    def _failed(self, rid: str, e: Exception) -> None:
        if self.failed is not None:
            self.failed(rid, e)
        else:
            log.error("request state not saved: %r", e, extra={"request_id": rid})

    def _extend(self, deadline_at: float | None) -> None:
        if deadline_at is None:
            self._forever = True
        else:  # in range: the model bounds it
            self._expiry_ms = max(self._expiry_ms, expiry_ms(deadline_at))

    async def load(self, client: aioredis.Redis, max_bytes: int) -> list[DurableRequest]:
        """Every state in the slot's hash, its stage data read back into `stage_data`;
        unreadable ones (a chunk missing or unreadable too), those whose deadline passed
        more than `GRACE_S` ago and chunks no state counts are dropped from it."""
        fields = cast("dict[bytes, bytes]", await client.hgetall(self.key))
        chunks: dict[str, dict[tuple[int, int], bytes]] = {}
        states: dict[str, bytes] = {}
        stale: list[str | bytes] = []
        for field, raw in fields.items():
            where = keys.split_state_chunk_field(field)
            if where is not None:
                chunks.setdefault(where[0], {})[where[1:]] = raw
                continue
            try:
                states[field.decode()] = raw
            except UnicodeDecodeError:
                log.error("unreadable request state field dropped: %r", field[:64])
                stale.append(field)
        found: list[DurableRequest] = []
        now = self.clock()
        for rid, raw in sorted(states.items()):
            try:
                doc = codec.decode_model(raw, DurableRequest, max_bytes=max_bytes)
                if doc.deadline_at is None or doc.deadline_at + GRACE_S >= now:
                    doc = _with_chunks(doc, chunks.get(rid, {}), max_bytes)
                    found.append(doc)
                    self._chunks[rid] = dict(doc.stage_chunks)
                    self._stored.add(rid)
                    self._extend(doc.deadline_at)
                    continue
            except (CodecError, ValidationError) as e:
                log.error("unreadable request state dropped: %s", e, extra={"request_id": rid})
            stale.append(rid)
        for rid, held in chunks.items():  # the stale states' chunks, and any no state counts
            counts = self._chunks.get(rid, {})
            stale.extend(
                keys.state_chunk_field(rid, sid, i)
                for sid, i in held
                if rid not in self._stored or i >= counts.get(sid, 0)
            )
        self._set = (self._expiry_ms, self._forever) if found else (0, False)
        if stale:
            await client.hdel(self.key, *stale)
        return found


def _fields(rid: str, had: dict[int, int], counts: dict[int, int]) -> list[str | bytes]:
    """The chunk fields a request had beyond what it keeps now (a stage finished: all)."""
    return [
        keys.state_chunk_field(rid, sid, i)
        for sid, n in had.items()
        for i in range(counts.get(sid, 0), n)
    ]


def _with_chunks(
    doc: DurableRequest, held: dict[tuple[int, int], bytes], max_bytes: int
) -> DurableRequest:
    """`doc` with the chunks it counts read into its `stage_data`; one missing is an error."""
    if not doc.stage_chunks:
        return doc  # written before chunk fields (its data inline), or keeping none
    data = dict(doc.stage_data)
    for sid, n in doc.stage_chunks.items():
        missing = [i for i in range(n) if (sid, i) not in held]
        if missing:
            raise CodecError(f"stage {sid} data: {len(missing)} of {n} chunks missing")
        data[sid] = [codec.decode(held[sid, i], max_bytes=max_bytes) for i in range(n)]
    return doc.model_copy(update={"stage_data": data})


def to_state(doc: DurableRequest) -> ReqState:
    """The core's `ReqState` of a loaded one."""
    return ReqState(
        prompt=doc.prompt,
        params=doc.params,
        submitted=set(doc.submitted),
        finished=set(doc.finished),
        stage_data={sid: list(data) for sid, data in doc.stage_data.items()},
    )
