"""Durable request states: one hash per orchestrator slot, a field per request in flight.

The orchestrator marks a request dirty whenever its routing state changes; as the
writer takes its next batch it asks `ops()` for one HSET carrying every dirty
request's state and one HDEL of every request that ended: two commands per batch
however many requests it touched. The writer puts those after the stream entries
they record (stage inputs, client outputs) and before the acknowledgements they
allow, in the same pipeline, so a state never claims what Redis does not have.
Coalesced: a request changed twice between batches is written once.

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

from omni_runtime import codec, keys
from omni_runtime.core.types import ReqState
from omni_runtime.errors import CodecError
from omni_runtime.messages import MAX_WALL_CLOCK_S, DurableRequest
from omni_runtime.redis_io.write_ops import ExpireAt, HashDrop, HashPut, Op
from omni_runtime.redis_io.writer import StreamWriter

log = logging.getLogger(__name__)

GRACE_S = 60.0
"""A state outlives its request's deadline by this long (a takeover then ends it)."""

Describe = Callable[[str, ReqState], dict[str, Any] | None]
"""A request's `DurableRequest` fields (None: do not keep it)."""
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
            self.writer.wake()

    def detach(self) -> None:
        """This slot is given up: nothing more of it is written."""
        self._dirty.clear()
        self._stored.clear()
        if self.ops in self.writer.sources:
            self.writer.sources.remove(self.ops)

    def ops(self) -> list[Op]:
        dirty, self._dirty = self._dirty, {}
        puts: dict[str, bytes] = {}
        drops: list[str] = []
        for rid, state in dirty.items():
            try:
                doc = None if state is None else self.describe(rid, state)
                if doc is None:
                    if rid in self._stored:  # else never written (it ended within one batch)
                        self._stored.discard(rid)
                        drops.append(rid)
                    continue
                deadline_at = doc["deadline_at"]
                until = None if deadline_at is None else expiry_ms(deadline_at)
                puts[rid] = codec.encode_decoded(doc)  # prompt and data as read
            except Exception as e:  # this request fails; the others' states are written
                self._failed(rid, e)
                continue
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

    async def load(self, client: aioredis.Redis, max_bytes: int) -> list[DurableRequest]:
        """Every state in the slot's hash; unreadable ones and those whose deadline passed
        more than `GRACE_S` ago are dropped from it."""
        fields = cast("dict[bytes, bytes]", await client.hgetall(self.key))
        found: list[DurableRequest] = []
        stale: list[str] = []
        now = self.clock()
        for raw_id, raw in sorted(fields.items()):
            rid = raw_id.decode()
            try:
                doc = codec.decode_model(raw, DurableRequest, max_bytes=max_bytes)
            except (CodecError, ValidationError) as e:
                log.error("unreadable request state dropped: %s", e, extra={"request_id": rid})
                stale.append(rid)
                continue
            if doc.deadline_at is not None and doc.deadline_at + GRACE_S < now:
                stale.append(rid)
                continue
            found.append(doc)
            self._stored.add(rid)
            if doc.deadline_at is None:
                self._forever = True
            else:  # in range: the model bounds it
                self._expiry_ms = max(self._expiry_ms, expiry_ms(doc.deadline_at))
        self._set = (self._expiry_ms, self._forever) if found else (0, False)
        if stale:
            await client.hdel(self.key, *stale)
        return found


def to_state(doc: DurableRequest) -> ReqState:
    """The core's `ReqState` of a loaded one."""
    return ReqState(
        prompt=doc.prompt,
        params=doc.params,
        submitted=set(doc.submitted),
        finished=set(doc.finished),
        stage_data={sid: list(data) for sid, data in doc.stage_data.items()},
    )
