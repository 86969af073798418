"""Inputs that outlived their processes run alone, so that one that kills whoever runs it
is told from the inputs that only ran beside it.

A process that dies (a native engine's segfault, the OOM killer) leaves every input it
held pending; each is delivered again, to a replica that takes it over or to the same
worker started again, and counted (`redelivery.py`). The count cannot say which input
killed the process: those in flight beside it are counted too. So an input on its last
delivery but one (`OMNI_MAX_DELIVERIES` - 1 deliveries, at least one) is a *suspect*: it
runs alone, once nothing else runs here, and nothing is read or started beside it. Just
before it starts, a marker is written (`Names.ran_alone`, with a TTL); it is deleted once
the suspect has ended here. A suspect delivered again with its marker still there killed
its process while it ran alone: it, and only it, is dead-lettered. The others finish,
each alone, however often they were delivered beside it (up to `HARD_LIMIT_EXTRA` more
than the limit, a bound for a process that keeps dying of something else; the rules:
`redelivery.is_suspect`).

Inputs delivered while suspects wait run after them; the reader reads nothing meanwhile
(`Slots.pause`). A draining worker leaves its suspects pending for a takeover, which
counts them, and hands the rest back.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable

import redis
from redis.exceptions import RedisError

from omni_runtime.keys import Names
from omni_runtime.observe.metrics import Metrics
from omni_runtime.worker.actions import Input
from omni_runtime.worker.io_threads import Slots

log = logging.getLogger(__name__)

MARKER_TTL_S = 24 * 3600
"""A suspect's marker outlives any takeover of its entry (seconds after a death)."""


class Isolation:
    """Admits a worker's inputs to its core so that each suspect runs alone."""

    def __init__(
        self, client: redis.Redis, names: Names, slots: Slots, stage_id: int, metrics: Metrics
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.marker: Callable[[bytes], str] = functools.partial(names.ran_alone, stage_id)
        self.slots = slots
        self.stage_id = stage_id
        self._suspects: deque[Input] = deque()
        self._waiting: list[Input] = []
        self._running: bytes | None = None
        """The entry of the suspect running alone now (its marker written)."""

    @property
    def active(self) -> bool:
        return bool(self._suspects) or self._running is not None

    def admit(self, inputs: list[Input], in_flight: int) -> list[Input]:
        """What the core takes now, of `inputs` and of what waits: everything, while no
        suspect is here; else the next suspect, alone, once nothing runs (`in_flight`)."""
        if not self.active and not any(i.solo for i in inputs):
            return inputs
        now: list[Input] = []
        holding = self.active  # those delivered beside the first suspects go first
        for inp in inputs:
            if self._holds(inp.entry_id):  # read again: what a takeover claimed at the start
                self.slots.give_back(1)  # is in the backlog the reader walks first
                continue
            if inp.solo:
                self._suspects.append(inp)
            elif holding:
                self._waiting.append(inp)
            else:
                now.append(inp)
        if self._suspects:
            self.slots.pause()
        if now or in_flight:
            return now
        if self._running is not None:  # the suspect alone ended here: it did not kill us
            self._forget(self._running)
            self._running = None
        if self._suspects:
            return self._next()
        waiting, self._waiting = self._waiting, []
        self.slots.resume()
        return waiting

    def _holds(self, entry_id: bytes) -> bool:
        if entry_id == self._running:
            return True
        return any(i.entry_id == entry_id for i in (*self._suspects, *self._waiting))

    def held(self) -> list[bytes]:
        """At a drain: the inputs waiting behind suspects, to hand back (the suspects stay
        pending, for a takeover to count)."""
        return [i.entry_id for i in self._waiting]

    def _next(self) -> list[Input]:
        suspect = self._suspects[0]
        try:  # written before it runs: a death from now on is its own
            self.client.set(self.marker(suspect.entry_id), 1, ex=MARKER_TTL_S)
        except RedisError as e:  # it waits: run unmarked, its death would blame nobody
            log.warning("stage %d: cannot mark a suspect input yet: %r", self.stage_id, e)
            return []
        self._suspects.popleft()
        self._running = suspect.entry_id
        self.metrics.inc("omni_inputs_run_alone_total", stage=str(self.stage_id))
        log.warning(
            "stage %d: input of request %r runs alone: it was in flight in processes that "
            "died (%d more wait)", self.stage_id, suspect.msg.request_id, len(self._suspects),
            extra={"request_id": suspect.msg.request_id},
        )  # fmt: skip
        return [suspect]

    def _forget(self, entry_id: bytes) -> None:
        try:
            self.client.delete(self.marker(entry_id))
        except RedisError as e:  # its entry is acked: the marker only expires
            log.warning("stage %d: cannot delete a suspect's marker: %r", self.stage_id, e)
