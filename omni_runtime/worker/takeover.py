"""Taking over the inputs of replicas that died, on the heartbeat thread.

A consumer of the stage's group whose heartbeat key expired holds inputs nobody
will finish: they are claimed (XCLAIM) and run here, but one delivered too often is
dead-lettered instead (`redelivery.py`).

A replica started in a dead one's place by a supervisor that saw it exit (`serve`,
`--replaces`) takes that one's inputs over at once instead: its process is gone, so
neither its heartbeat's TTL nor the idle fence that guards a replica that only stalled
has anything to wait for.

The dead replica's connections are closed first (CLIENT KILL by the name every worker
connection carries, `name_connections`): one that only stalled (SIGSTOP) would otherwise
land, on waking, a write that passed its fence just before the stall (`fence.py`);
closed, that write fails, and its retry meets the fence.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.exceptions import RedisError
from redis.typing import StreamIdT

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io import conn as rconn
from omni_runtime.redis_io.backoff import RetrySettings
from omni_runtime.redis_io.clients import is_cluster
from omni_runtime.redis_io.streams import Entry, SyncDeadLetters, SyncGroupReader
from omni_runtime.wire.views import StageInputView
from omni_runtime.worker.actions import Input
from omni_runtime.worker.fence import StallGuard
from omni_runtime.worker.io_threads import HeartbeatThread, retries_s
from omni_runtime.worker.redelivery import Redelivery, deliveries

log = logging.getLogger(__name__)

CLAIM_PAGE = 100
"""Pending entries of one dead consumer claimed per heartbeat."""

REPLACED_MIN_IDLE_MS = 1_000
"""The idle fence for the inputs of the replica this one replaces: no stall to wait out,
only another replica's claim of the same inputs, which resets their idle time (so a
claimant that paused this long between listing and claiming them cannot take them twice)."""


def name_connections(client: redis.Redis, names: keys.Names, stage_id: int, worker_id: str) -> None:
    """Every connection `client` opens from now on carries this worker's name (a single
    server: on a cluster the time fence alone guards a stalled replica's writes)."""
    if not is_cluster(client):
        rconn.name_connections(client, names.worker_connection(stage_id, worker_id))


@dataclass(frozen=True, slots=True)
class TakeoverSettings:
    """What the heartbeat and its takeovers take of the settings (`Settings.part`)."""

    names: keys.Names
    heartbeat_interval_s: float
    heartbeat_ttl_ms: int
    """A consumer is dead once its heartbeat key expired: its entries idle this long."""
    max_deliveries: int
    retry: RetrySettings


class Takeover:
    """Callable after each heartbeat: claims the pending inputs of dead replicas."""

    def __init__(
        self,
        client: redis.Redis,
        reader: SyncGroupReader[StageInputView],
        deliver: Callable[[list[Input]], None],
        settings: TakeoverSettings,
        *,
        worker_id: str,
        stage_id: int,
        metrics: Metrics,
        replaces: str | None = None,
    ) -> None:
        self.client = client
        self.reader = reader
        self.deliver = deliver
        self.settings = settings
        self.names = settings.names
        self.worker_id = worker_id
        self.stage_id = stage_id
        self.min_idle_ms = settings.heartbeat_ttl_ms
        self.replaces = replaces if replaces != worker_id else None
        """A dead replica's consumer name (`serve` saw its process exit); its own name is
        no other's: what a previous life left under it is this one's backlog."""
        self.metrics = metrics
        self.stream = reader.stream
        self._can_disconnect = not is_cluster(client)
        dead_letters = SyncDeadLetters(
            client,
            self.names.dead_letters,
            metrics=metrics,
            backoff=settings.retry.backoff(bounded=True),
        )
        self.redelivery = Redelivery(
            client, self.stream, dead_letters, settings.max_deliveries, stage_id,
            functools.partial(self.names.ran_alone, stage_id),
        )  # fmt: skip
        """Also what the input thread counts its backlog's deliveries with."""

    def heartbeat(self, status: Callable[[], dict[str, Any]], guard: StallGuard) -> HeartbeatThread:
        """The worker's heartbeat thread: after each beat it runs this takeover, then lets
        the stall guard see that the beat was in time."""
        return HeartbeatThread(
            self.client,
            self.names.stage_heartbeat(self.stage_id, self.worker_id),
            self.settings.heartbeat_interval_s,
            self.settings.heartbeat_ttl_ms,
            status,
            self,
            guard.after_beat,
            retries_s(self.settings.retry),
        )

    def __call__(self) -> None:
        summary: Any = self.client.xpending(self.stream, keys.WORKERS_GROUP)
        for consumer in summary.get("consumers") or []:
            name = consumer["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name == self.replaces:
                self._take_over(name, REPLACED_MIN_IDLE_MS)
            elif name != self.worker_id and not self._alive(name):
                self._take_over(name, self.min_idle_ms)

    def replace(self) -> None:
        """At start: the replaced replica is no live worker (`status`), and its inputs
        idle long enough are claimed now, not a heartbeat later (the rest at each beat)."""
        if self.replaces is None:
            return
        try:
            self.client.delete(self.names.stage_heartbeat(self.stage_id, self.replaces))
            self._take_over(self.replaces, REPLACED_MIN_IDLE_MS)
        except RedisError as e:  # the heartbeat's takeovers, which retry, will
            log.warning("cannot take over the inputs of %s yet: %r", self.replaces, e)

    def _alive(self, name: str) -> bool:
        return bool(self.client.exists(self.names.stage_heartbeat(self.stage_id, name)))

    def _take_over(self, name: str, min_idle_ms: int) -> None:
        rows = self.client.xpending_range(
            self.stream, keys.WORKERS_GROUP, min="-", max="+", count=CLAIM_PAGE, consumername=name
        )
        if not rows:
            self.client.xgroup_delconsumer(self.stream, keys.WORKERS_GROUP, name)
            return
        self._disconnect(name)
        ids: list[StreamIdT] = [row["message_id"] for row in rows]
        delivered = deliveries(rows)
        # Without justid XCLAIM returns entries, of bytes for our clients (the stub allows
        # ids only, and str); one whose entry was deleted comes back as (None, None).
        claimed = cast(
            "list[Entry]",
            self.client.xclaim(
                self.stream,
                keys.WORKERS_GROUP,
                self.worker_id,
                min_idle_time=min_idle_ms,
                message_ids=ids,
            ),
        )
        entries = [(eid, fields) for eid, fields in claimed if fields]
        if not entries:
            return
        log.warning("took over %d input(s) of dead replica %s", len(entries), name)
        self.metrics.inc("omni_takeovers_total", len(entries), stage=self.stage_id)
        accepted = self.reader.accept(entries)
        inputs = self.redelivery.inputs(accepted, delivered, dict(entries), taken_over=True)
        if inputs:
            self.deliver(inputs)

    def _disconnect(self, name: str) -> None:
        """Close the dead replica's connections (see the module's docstring)."""
        if not self._can_disconnect:
            return
        wanted = self.names.worker_connection(self.stage_id, name)
        try:
            for conn in self.client.client_list():
                if conn.get("name") == wanted:
                    self.client.client_kill_filter(_id=conn["id"])
        except RedisError as e:  # e.g. an ACL user without CLIENT KILL: the time fence alone
            log.warning("cannot close the connections of dead replica %s: %r", name, e)
            self._can_disconnect = False
