"""An input delivered too often is not run again: it may be what kills whoever runs it.

An input is delivered again when the process it was given to died before finishing it,
in one of two ways: a live replica takes a dead one's inputs over (`takeover.py`), or a
worker started again under the same consumer name (`--worker-id`: a systemd unit, a
pod's container restarted in place) reads its own backlog, what its previous life was
given and never finished. Either way, one on its last delivery but one runs alone
(`isolation.py`), and one that killed its process while it ran alone is dead-lettered
and its request ends with one error output, unrun; the inputs that were only in flight
beside it are not. Without this, a request that crashes its worker would, under a
stable consumer name, crash every new life of it for good, and the stage with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis
from redis.exceptions import RedisError

from omni_runtime import keys
from omni_runtime.redis_io.streams import SyncDeadLetters
from omni_runtime.wire.views import StageInputView
from omni_runtime.worker.actions import Input

log = logging.getLogger(__name__)

MAX_REMEMBERED = 10_000
"""A previous life's pending inputs counted at most (a worker holds its concurrency's)."""


HARD_LIMIT_EXTRA = 10
"""Deliveries past `OMNI_MAX_DELIVERIES` after which an input is dead-lettered whatever
its marker says: each death of a suspect run alone before it delivers it once more."""


def is_suspect(times: int, max_deliveries: int) -> bool:
    """`times`: deliveries before this one. The last delivery but one, or later, of an
    input delivered before, makes it a suspect, which runs alone (`isolation.py`); so does
    any second delivery when the limit is one."""
    return times >= max(1, max_deliveries - 1)


class Redelivery:
    """Sorts inputs delivered again into those to run and those dead-lettered."""

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        dead_letters: SyncDeadLetters,
        max_deliveries: int,
        stage_id: int,
        marker: Callable[[bytes], str],
    ) -> None:
        """`marker`: an entry's key that says it ran alone (`Names.ran_alone`)."""
        self.client = client
        self.marker = marker
        self.stream = stream
        self.dead_letters = dead_letters
        self.max_deliveries = max_deliveries
        self.stage_id = stage_id
        self.previous: dict[bytes, int] = {}
        """Entry → deliveries, of what a previous life left pending under this name."""

    def inputs(
        self,
        accepted: Sequence[tuple[bytes, StageInputView]],
        runs: Mapping[bytes, int],
        raw: Mapping[bytes, Mapping[bytes, bytes]],
        *,
        taken_over: bool,
    ) -> list[Input]:
        """`runs`: how often each entry was delivered before this delivery; `raw`: the
        entries' fields, what a dead letter keeps (one missing is read back)."""
        inputs: list[Input] = []
        for eid, msg in accepted:
            times = runs.get(eid, 0)
            suspect = is_suspect(times, self.max_deliveries)
            error = self._killer(eid, times) if suspect else None
            if error is None:
                inputs.append(Input(eid, msg, taken_over=taken_over, solo=suspect))
                continue
            log.error(
                "stage %d: %s: request %r", self.stage_id, error, msg.request_id,
                extra={"request_id": msg.request_id},
            )  # fmt: skip
            fields = raw.get(eid) or self._fields(eid)
            self.dead_letters.send(self.stream, keys.WORKERS_GROUP, eid, error, fields)
            inputs.append(Input(eid, msg, refused=error, taken_over=taken_over))
        return inputs

    def _killer(self, entry_id: bytes, times: int) -> str | None:
        """Why a suspect is dead-lettered, if it is: it killed its process while running
        alone (its marker is there), or it outlived `HARD_LIMIT_EXTRA` more deliveries."""
        limit = self.max_deliveries
        if times >= limit + HARD_LIMIT_EXTRA:
            return (
                f"input delivered {times} times without finishing "
                f"(OMNI_MAX_DELIVERIES={limit}, + {HARD_LIMIT_EXTRA} run alone); dead-lettered"
            )
        try:
            alone = self.client.delete(self.marker(entry_id))
        except RedisError as e:  # not known to have run alone: it runs alone (again)
            log.warning("stage %d: cannot read a suspect's marker: %r", self.stage_id, e)
            return None
        if not alone:
            return None
        return (
            f"input delivered {times} times without finishing, the last time alone: it "
            f"killed its worker (OMNI_MAX_DELIVERIES={limit}); dead-lettered"
        )

    def remember_previous_life(self, consumer: str) -> None:
        """Before this process takes any input: how often each input still pending under
        its consumer name (a previous life's) was delivered. Counted then, not as the
        backlog is read: a backlog read again later (after a failed read) holds what this
        life runs, and what a takeover claimed into it was counted by the takeover."""
        try:
            rows: Any = self.client.xpending_range(
                self.stream, keys.WORKERS_GROUP, min="-", max="+",
                count=MAX_REMEMBERED, consumername=consumer,
            )  # fmt: skip
        except RedisError as e:  # its backlog runs as it did before deliveries were counted
            log.warning("stage %d: cannot count its backlog's deliveries: %r", self.stage_id, e)
            return
        self.previous = deliveries(rows)

    def backlog(self, read: Sequence[tuple[bytes, StageInputView]]) -> list[Input]:
        """Inputs read from this consumer's own backlog: a previous life's that ran
        `OMNI_MAX_DELIVERIES` times already are dead-lettered."""
        if not any(eid in self.previous for eid, _msg in read):
            return [Input(eid, msg) for eid, msg in read]
        inputs = self.inputs(read, self.previous, {}, taken_over=False)
        for refused in (i for i in inputs if i.refused is not None):
            del self.previous[refused.entry_id]
        return inputs

    def _fields(self, entry_id: bytes) -> Mapping[bytes, bytes] | None:
        entries: Any = self.client.xrange(self.stream, entry_id, entry_id, count=1)
        return entries[0][1] if entries else None


def deliveries(pending: Any) -> dict[bytes, int]:
    """XPENDING's rows as entry id → how often it was delivered."""
    return {_id(row["message_id"]): int(row["times_delivered"]) for row in pending}


def _id(entry_id: object) -> bytes:
    return entry_id if isinstance(entry_id, bytes) else str(entry_id).encode()
