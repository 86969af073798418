"""The control stream's dead letters: the orchestrators' consumer group on `<ns>:control`.

Workers follow the control stream (aborts) with a plain `XREAD`, every one of them
every entry: a broadcast has no single reader that could dead-letter a malformed
entry once. So the orchestrators, which write it, also read it in their group, one
consumer per slot like their other streams: a good entry is acknowledged (and left
for the workers; age trims it), a malformed one is dead-lettered, counted and
deleted, as on every other stream. A slot taken over walks the control backlog its
previous holder left, then stops.
"""

from __future__ import annotations

import asyncio
import logging

from omni_runtime import keys
from omni_runtime.orchestrator.backlog import read_backlog
from omni_runtime.orchestrator.shared import Shared
from omni_runtime.redis_io.clients import REDIS_FAILURES
from omni_runtime.redis_io.streams import GroupReader
from omni_runtime.wire.messages import AbortMsg

log = logging.getLogger(__name__)

RETRY_S = 0.5
"""After an unexpected failure the reader tries again this much later."""


class ControlGuard:
    """One slot's consumer of the control stream: acknowledges good entries, dead-letters
    malformed ones (`GroupReader` does the latter)."""

    def __init__(self, shared: Shared, slot: int, home: bool) -> None:
        s = shared.settings
        self.shared = shared
        self.home = home
        self.stream = s.names.control
        self.reader: GroupReader[AbortMsg] = GroupReader(
            shared.client,
            self.stream,
            keys.ORCHESTRATOR_GROUP,
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
        """Nothing here is urgent: the idle block, within the lease fence."""
        idle = self.shared.settings.orchestrator_idle_block_ms
        return min(idle, self.shared.leases.read_block_ms())

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
            for entry_id, _abort in batch:  # the workers act on it; read here to vet it
                self.shared.writer.xack(self.stream, keys.ORCHESTRATOR_GROUP, entry_id)
        self.backlog_done = True
