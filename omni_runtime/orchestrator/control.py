"""The orchestrators on the control stream (`<ns>:control`, aborts): each slot reads every
entry, in a consumer group of its own (`keys.control_group`).

Workers follow the control stream with a plain `XREAD`, every one of them every entry:
a broadcast has no single reader that could dead-letter a malformed entry once. So the
orchestrators, which write it, also read it in groups: a good entry is acknowledged (and
left for the workers; age trims it), a malformed one is dead-lettered, counted and
deleted, as on every other stream (once per slot that read it before it was deleted).

An abort the requests stream brought to a slot that does not own the request (the
slots share that stream's entries out, a request and its abort each to any of them) is
written here by that slot (`slot.py`), so the owner reads it too: each slot hands every
abort to `on_abort`, which ends a request it owns and remembers one it does not (its
request may be on its way to it). A slot taken over walks the control backlog its
previous holder left (aborts of the requests it restored among them), then stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from omni_runtime import keys
from omni_runtime.orchestrator.backlog import read_backlog
from omni_runtime.orchestrator.shared import Shared
from omni_runtime.redis_io.clients import REDIS_FAILURES
from omni_runtime.redis_io.streams import GroupReader, entry_fields
from omni_runtime.wire.messages import AbortMsg

log = logging.getLogger(__name__)

RETRY_S = 0.5
"""After an unexpected failure the reader tries again this much later."""
MAX_UNOWNED = 10_000
"""Aborts of requests a slot does not hold that it remembers (for `keys.RECENT_ABORTS_S`)."""


class ControlGuard:
    """One slot's reader of the control stream: ends the requests it holds that an abort
    there names, acknowledges good entries, dead-letters malformed ones (`GroupReader`
    does the latter)."""

    def __init__(
        self,
        shared: Shared,
        slot: int,
        home: bool,
        owns: Callable[[str], bool],
        abort: Callable[[str, str], Awaitable[None]],
    ) -> None:
        """`owns`: whether this slot holds a request in flight; `abort`: end one it holds."""
        s = shared.settings
        self.shared = shared
        self.home = home
        self.owns, self.abort = owns, abort
        self.unowned: OrderedDict[str, tuple[float, str]] = OrderedDict()
        """Aborts of requests this slot did not hold when it read them: when, and why."""
        self.stream = s.names.control
        self.group = keys.control_group(slot)
        self.reader: GroupReader[AbortMsg] = GroupReader(
            shared.client,
            self.stream,
            self.group,
            keys.orchestrator_consumer(slot),
            AbortMsg,
            max_bytes=s.max_message_bytes,
            dead_letters=s.names.dead_letters,
            metrics=shared.obs.metrics,
            backoff=s.retry.backoff(bounded=True),
            block_budget=self._block_ms,
        )
        self.backlog_done = False
        self._stopping = False

    def _block_ms(self) -> int:
        """A read returns as an entry comes: the idle block, within the lease fence."""
        idle = self.shared.settings.orchestrator_idle_block_ms
        return min(idle, self.shared.leases.read_block_ms())

    async def on_abort(self, request_id: str, reason: str) -> None:
        """End the request if this slot holds it, else remember the abort a while: its
        request may reach this slot after it (`taken_abort`)."""
        if self.owns(request_id):
            await self.abort(request_id, reason)
            return
        self.unowned[request_id] = (time.monotonic(), reason)
        self.unowned.move_to_end(request_id)
        while len(self.unowned) > MAX_UNOWNED:
            self.unowned.popitem(last=False)

    def taken_abort(self, request_id: str) -> str | None:
        """Why a request this slot has just taken was aborted before, if it was."""
        horizon = time.monotonic() - keys.RECENT_ABORTS_S
        while self.unowned and next(iter(self.unowned.values()))[0] < horizon:
            self.unowned.popitem(last=False)
        remembered = self.unowned.pop(request_id, None)
        return remembered[1] if remembered is not None else None

    def forward(self, request_id: str, reason: str) -> None:
        """An abort of the requests stream whose request this slot does not hold: on the
        control stream, for the slot that holds it (and the workers)."""
        msg = entry_fields(AbortMsg(request_id=request_id, reason=reason))
        self.shared.writer.xadd(self.stream, msg, max_age_s=keys.CONTROL_STREAM_AGE_S)

    def interrupt(self) -> None:
        self._stopping = True
        self.reader.interrupt()

    async def run(self) -> None:
        """Until interrupted or deposed (a slot taken over: until its backlog is walked)."""
        s = self.shared.settings
        while not self._stopping:
            if not await self.shared.leases.hold():
                return
            try:
                if self.home:
                    batch = await self.reader.read(s.read_count, s.block_ms)
                else:
                    backlog = await read_backlog(self.reader, s.read_count)
                    if backlog is None:
                        break
                    batch = backlog
            except REDIS_FAILURES as e:  # what the reader does not retry itself (an error reply,
                # a cluster's): retried here, or this slot's control entries would stay pending
                self.shared.obs.metrics.inc("omni_contained_errors_total", where="reading control")
                log.error("reading %s failed: %r", self.stream, e, exc_info=e)
                await asyncio.sleep(RETRY_S)
                continue
            self.backlog_done |= not self.reader.cursor.in_backlog
            for entry_id, aborted in batch:  # the workers act on it too
                await self.on_abort(aborted.request_id, aborted.reason)
                self.shared.writer.xack(self.stream, self.group, entry_id)
        self.backlog_done = True
