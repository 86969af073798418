"""What an orchestrator process watches once per heartbeat interval, over every slot it serves.

It beats the orchestrator heartbeat (clients wait for one), notices Redis coming
back empty (every request in flight lost its state: each ends with one error at
once), stages with no live worker (their requests fail) and clients gone away
(their requests are aborted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from omni_runtime.observe.redis_stats import heartbeat_value
from omni_runtime.orchestrator.shared import Shared
from omni_runtime.orchestrator.slot import SlotService
from omni_runtime.redis_io.liveness import Absence, Replicas, StateEpoch, no_live_worker
from omni_runtime.redis_io.mode_check import orchestrator_beat
from omni_runtime.redis_io.refusals import is_oom
from omni_runtime.redis_io.streams import ensure_group
from omni_runtime.wire.messages import REDIS_LOST_STATE

log = logging.getLogger(__name__)


class Watch:
    def __init__(self, shared: Shared, slots: Callable[[], list[SlotService]]) -> None:
        self.shared = shared
        self.slots = slots
        self.names = shared.settings.names
        self._clients_absent = Absence(shared.settings.heartbeat_ttl_s)
        self._epoch = StateEpoch(shared.client, self.names.epoch)
        self.replicas = Replicas(shared.client, self.names, shared.pipeline.last_stage + 1)
        self._beat = orchestrator_beat(shared.pipeline)
        """The heartbeat's value: the pipeline and its mode (`mode_check`)."""
        self.own_heartbeat = self.names.orchestrator_process_heartbeat(shared.leases.token)

    async def once(self, now: float) -> None:
        """One look: beat, Redis restarts, stages, clients (raises `RedisError`). One
        round trip while every stage keeps its known replica. Redis out of memory refuses
        the heartbeat's SET, not its PEXPIRE: the look goes on, and clients still see an
        orchestrator."""
        s = self.shared.settings
        client_ids = sorted({cid for slot in self.slots() for cid in slot.client_of.values()})
        heartbeat = self.names.orchestrator_heartbeat()
        async with self.shared.client.pipeline(transaction=False) as pipe:
            pipe.set(heartbeat, self._beat, px=s.heartbeat_ttl_ms)
            pipe.pexpire(heartbeat, s.heartbeat_ttl_ms)  # kept alive if Redis refuses the SET
            pipe.set(self.own_heartbeat, self._own_beat(), px=s.heartbeat_ttl_ms)
            pipe.get(self.names.epoch)
            queued = self.replicas.queue(pipe)
            for cid in client_ids:
                pipe.exists(self.names.client_heartbeat(cid))
            replies = await pipe.execute(raise_on_error=False)
        for i, reply in enumerate(replies):  # out of memory refuses the SETs alone
            if isinstance(reply, RedisError) and not (i in (0, 2) and is_oom(reply)):
                raise reply
        if await self._epoch.lost_given(replies[3]):
            await self.redis_restarted(now)
        stage_replies = replies[4 : 4 + len(queued)]
        await self._stages_are(await self.replicas.settle(queued, stage_replies), now)
        await self._clients_are(client_ids, replies[4 + len(queued) :], now)

    def _own_beat(self) -> str:
        """This process's row in `status`: where it runs, its requests in flight and done."""
        return heartbeat_value(
            in_flight=sum(len(slot.client_of) for slot in self.slots()),
            completed=self.shared.timer.ended_total,
        )

    def unreachable(self, now: float) -> None:
        """A look failed: Redis is unreachable (or failing over). Heartbeats written
        meanwhile failed too, and a failover may lose the last ones: missing keys prove
        nothing until every process has had a whole TTL to beat again, after the last
        failure. Without this, one outage longer than the TTL fails every request of a
        stage whose worker is alive."""
        self._clients_absent.reset()
        self.shared.stage_watch.restarted(now)

    def busy(self) -> bool:
        """Whether any slot served here has requests in flight."""
        return any(slot.client_of for slot in self.slots())

    async def redis_restarted(self, now: float) -> None:
        """Redis came back empty: every request in flight lost its inputs and outputs. End
        each with one error at once (none waits for its deadline); groups are recreated."""
        slots = self.slots()
        log.error(
            "Redis restarted empty: ending %d requests in flight",
            sum(len(slot.client_of) for slot in slots),
        )
        self.shared.obs.metrics.inc("omni_redis_restarts_total")
        self._clients_absent.reset()
        self.shared.stage_watch.restarted(now)
        for slot in slots:
            for stream, group in slot.groups():
                await ensure_group(self.shared.client, stream, group)
            for rid in list(slot.client_of):
                self.shared.obs.metrics.inc("omni_aborts_total", reason="redis restarted")
                await slot.core.abort_request(rid, REDIS_LOST_STATE)

    async def stages(self, now: float) -> None:
        await self._stages_are(await self.replicas.look(), now)

    async def _stages_are(self, live: list[tuple[int, bool]], now: float) -> None:
        shared = self.shared
        new, back = shared.stage_watch.update(live, now)
        for sid in sorted(back):
            log.warning("stage %d has a live worker again", sid)
        for sid in sorted(new):
            log.error("stage %d has no live worker: failing its requests", sid)
            shared.obs.metrics.inc("omni_stage_down_total", stage=sid)
            for slot in self.slots():
                states = slot.core.request_states
                for rid in list(slot.client_of):
                    state = states.get(rid)
                    if state is None or sid not in state.finished:
                        shared.obs.metrics.inc("omni_aborts_total", reason="no live worker")
                        await slot.core.abort_request(rid, no_live_worker(sid))

    async def _clients_are(self, client_ids: list[str], alive: list[Any], now: float) -> None:
        """Abort the requests of clients gone for longer than the heartbeat TTL: a key
        missing once may just be Redis back empty before the client beat again."""
        present = {cid: bool(ok) for cid, ok in zip(client_ids, alive, strict=True)}
        gone = self._clients_absent.update(present, now)
        if not gone:
            return
        for slot in self.slots():
            for rid, cid in list(slot.client_of.items()):
                if cid in gone:
                    self.shared.obs.metrics.inc("omni_aborts_total", reason="client went away")
                    await slot.core.abort_request(rid, "client went away")


async def pause(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep, but wake at once on shutdown: loops end between commands, never inside one."""
    try:
        async with asyncio.timeout(seconds):
            await stopping.wait()
    except TimeoutError:
        pass
