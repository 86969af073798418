"""Durable request states: one key per request in flight, indexed by its owner's slot.

The orchestrator marks a request dirty whenever its routing state changes; as the
writer takes its next batch it asks `ops()` for one SET (with a TTL: the time left
to the deadline plus a grace, so a late takeover still ends it with its error) per
dirty request, or one DEL for a request that ended. The writer puts those after the
stream entries they record (stage inputs, client outputs) and before the
acknowledgements they allow, in the same pipeline: the cost per hop is a few
commands more in a round trip that was made anyway, and a state never claims what
Redis does not have. Coalesced: a request changed twice between batches is written once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from pydantic import ValidationError

from omni_runtime import codec, keys
from omni_runtime.core.types import ReqState
from omni_runtime.errors import CodecError
from omni_runtime.messages import DurableRequest
from omni_runtime.redis_io.writer import Forget, Op, Put, StreamWriter

log = logging.getLogger(__name__)

GRACE_S = 60.0
"""A state outlives its request's deadline by this long (a takeover then ends it)."""

Describe = Callable[[str, ReqState], dict[str, Any] | None]
"""A request's `DurableRequest` fields (None: do not keep it)."""


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
    ) -> None:
        self.writer = writer
        self.names = names
        self.slot = slot
        self.index = names.orchestrator_requests(slot)
        self.describe = describe
        self.enabled = enabled
        self.clock = clock
        self._dirty: dict[str, ReqState | None] = {}
        self._indexed: set[str] = set()
        """Requests already named in the index: later writes are one SET each."""
        if enabled:
            writer.sources.append(self.ops)

    def __len__(self) -> int:
        return len(self._dirty)

    def changed(self, request_id: str, state: ReqState | None) -> None:
        """`state` None: the request ended (its key goes)."""
        if self.enabled:
            self._dirty[request_id] = state
            self.writer.wake()

    def detach(self) -> None:
        """This slot is given up: nothing more of it is written."""
        self._dirty.clear()
        self._indexed.clear()
        if self.ops in self.writer.sources:
            self.writer.sources.remove(self.ops)

    def ops(self) -> list[Op]:
        dirty, self._dirty = self._dirty, {}
        out: list[Op] = []
        for rid, state in dirty.items():
            key = self.names.request_state(rid)
            doc = None if state is None else self.describe(rid, state)
            if doc is None:
                if rid in self._indexed:  # never written (it ended within one batch): no-op
                    self._indexed.discard(rid)
                    out.append(Forget(key, self.index, rid))
                continue
            ttl_ms = None
            if doc["deadline_at"] is not None:
                ttl_ms = max(1, int((doc["deadline_at"] - self.clock() + GRACE_S) * 1000))
            try:
                value = codec.encode(doc)
            except CodecError as e:  # its data cannot be kept: it still runs, not durably
                log.error("request state not saved: %s", e, extra={"request_id": rid})
                continue
            index = None if rid in self._indexed else self.index
            self._indexed.add(rid)
            out.append(Put(key, value, ttl_ms, index, rid))
        return out

    async def load(self, client: aioredis.Redis, max_bytes: int) -> list[DurableRequest]:
        """Every state the slot's index names; entries whose key is gone or unreadable are
        dropped from the index (a lapsed key: its request's deadline passed long ago)."""
        members = sorted(
            m.decode() if isinstance(m, bytes) else str(m)
            for m in await client.smembers(self.index)
        )
        if not members:
            return []
        async with client.pipeline(transaction=False) as pipe:
            for rid in members:
                pipe.get(self.names.request_state(rid))
            values = await pipe.execute()
        found: list[DurableRequest] = []
        stale: list[str] = []
        for rid, raw in zip(members, values, strict=True):
            if raw is None:
                stale.append(rid)
                continue
            try:
                doc = codec.decode_model(raw, DurableRequest, max_bytes=max_bytes)
            except (CodecError, ValidationError) as e:
                log.error("unreadable request state dropped: %s", e, extra={"request_id": rid})
                stale.append(rid)
                continue
            found.append(doc)
            self._indexed.add(rid)
        if stale:
            await client.srem(self.index, *stale)
        return found


def to_state(doc: DurableRequest) -> ReqState:
    """The core's `ReqState` of a loaded one."""
    return ReqState(
        prompt=doc.prompt,
        submitted=set(doc.submitted),
        finished=set(doc.finished),
        stage_data={sid: list(data) for sid, data in doc.stage_data.items()},
    )
