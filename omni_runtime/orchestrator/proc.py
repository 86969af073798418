"""The orchestrator process: the very SPEC §3 Orchestrator, wired to Redis streams.

Several such processes may serve one namespace, all active. Each takes the lowest
free orchestrator slot (a lease, `redis_io.leases`) and serves it: a `SlotService`
reads requests under the slot's consumer name, runs them through the pipeline and
delivers each `OrchOutput` to the stream of the client that asked; workers answer
on the slot's own output streams. Request state is kept in Redis as it changes, so
when a slot's lease lapses (its process died or stalled) a live process takes the
slot over, restores its requests and finishes them, then gives the slot back. A
process that finds one of its leases taken stops: it was deposed, and its writes
are refused from the moment its lease could have lapsed. A process whose slot loop (or
event loop) stops making progress gives its leases back and exits (`watchdog`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from typing import cast

from redis.exceptions import RedisError

from omni_runtime import keys
from omni_runtime.core.orchestrator import Orchestrator
from omni_runtime.core.tasks import cancel_and_wait
from omni_runtime.errors import TransportError
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.probes import Probes
from omni_runtime.observe.start import Observability, ObserveSettings
from omni_runtime.observe.timings import RequestTimer
from omni_runtime.orchestrator.build import build_orchestrator as build_orchestrator
from omni_runtime.orchestrator.leases import LeaseLost, Leases
from omni_runtime.orchestrator.shared import Shared, SlotSettings
from omni_runtime.orchestrator.slot import SlotService
from omni_runtime.orchestrator.stage_client import RedisStageClient
from omni_runtime.orchestrator.watch import Watch, pause
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.redis_io.backoff import RetrySettings
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.conn import name_connections
from omni_runtime.redis_io.liveness import StageWatch
from omni_runtime.redis_io.mode_check import check_orchestrator_mode
from omni_runtime.redis_io.streams import GroupReader
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.settings import Settings
from omni_runtime.watchdog import Progress, Stuck, Watchdog
from omni_runtime.wire import codec
from omni_runtime.wire.views import AbortView, RequestView

log = logging.getLogger(__name__)

TEST_WEDGE_AFTER = "OMNI_TEST_WEDGE_AFTER"
"""A test hook, for the watchdog's fault scenario only: set to N, a slot's request loop
blocks for good before it takes its (N+1)th entry, as a bug would wedge it."""
FLUSH_TIMEOUT_S = 2.0
GIVE_BACK_S = 3.0
"""A wedged process's last act, giving its leases back, gets this long (else they lapse)."""


class OrchestratorService:
    """One orchestrator process: built whole here, served by `run` (once)."""

    def __init__(
        self,
        pipeline: PipelineConfig,
        settings: Settings,
        clients: RedisClients | None = None,
        metrics: Metrics | None = None,
        *,
        orchestrator_id: str | None = None,
        replaces: str | None = None,
    ) -> None:
        """`orchestrator_id`: its token in the leases (default: random); `replaces`: that
        of a process that exited, whose slots it takes at once (`Leases.release_dead`)."""
        s = settings
        self.pipeline = pipeline
        self.replaces = replaces
        self.settings = settings
        self.names = s.names
        self.obs = Observability(metrics)
        """Handed to every part that counts or stamps; started by `run`."""
        self.observe = s.part(ObserveSettings)
        self.metrics = self.obs.metrics
        self.clients = clients or RedisClients.connect(s.redis_url, s.redis_cluster, s.namespace)
        self.client = self.clients.aio()
        self.leases = Leases(self.client, self.names, s.orchestrator_lease_ttl_s, orchestrator_id)
        if self.leases.can_disconnect:  # a takeover closes them by name (CLIENT KILL)
            name_connections(self.client, self.leases.client_name)
        retry = s.part(RetrySettings)
        self.writer = StreamWriter(
            self.client,
            s.stream_maxlen,
            obs=self.obs,
            backoff=retry.backoff(bounded=True),
            fence=self.leases,
            on_failed=self._writes_failed,
        )
        self.timer = RequestTimer(self.metrics)
        ttl_s = s.heartbeat_ttl_s or float(keys.HEARTBEAT_TTL_S)
        slot_settings = s.part(SlotSettings, retry=retry)
        self.shared = Shared(
            pipeline,
            slot_settings,
            self.client,
            self.writer,
            self.leases,
            self.obs,
            self.timer,
            StageWatch(ttl_s, 0.0, holds=s.scale_to_zero),
            recheck_stages=self._recheck_stages,
            wedge_after=_wedge_after(),
        )
        self.watch = Watch(self.shared, lambda: list(self.slots.values()))
        self.slots: dict[int, SlotService] = {}
        self.home: SlotService | None = None
        self.deposed: LeaseLost | None = None
        self.takeovers: list[tuple[int, int, float]] = []
        """(slot, requests restored, seconds from noticing the lapse to serving)."""
        self.ready = asyncio.Event()
        self._stopping = asyncio.Event()
        self._look_now = asyncio.Event()
        """Set by a released-slot notice (and at shutdown): the lease round runs at once."""
        self.watchdog: Watchdog | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _writes_failed(self, request_ids: list[str], error: TransportError) -> None:
        """Redis refused writes of these requests for good (or for memory, too long): each
        ends alone, with one error final saying so; the rest of their batch was written."""
        for slot in self.slots.values():
            for rid in request_ids:
                if rid in slot.client_of:
                    self.metrics.inc("omni_aborts_total", reason="write refused")
                    slot.core.abort_soon(rid, str(error))

    @property
    def orchestrator(self) -> Orchestrator:
        """The core of this process's own slot."""
        if self.home is None:
            raise RuntimeError("the orchestrator is not running")
        return self.home.core

    @property
    def requests(self) -> GroupReader[RequestView | AbortView]:
        """The requests reader of this process's own slot."""
        if self.home is None:
            raise RuntimeError("the orchestrator is not running")
        return self.home.requests

    @property
    def stages(self) -> list[RedisStageClient]:
        return [] if self.home is None else self.home.stages

    @property
    def malformed_requests(self) -> int:
        return int(self.metrics.value("omni_malformed_entries_total", stream=self.names.requests))

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set (or this process is deposed), then flush and close."""
        codec.warm_up()
        self.shared.stage_watch.restarted(asyncio.get_running_loop().time())
        probes = Probes(ready=self._not_ready)
        self.obs.start(
            self.observe, "orchestrator", self.clients.sync, poll_streams=True, probes=probes
        )
        self.metrics.gauge_callback("omni_requests_running", self.timer.running_count)
        writer_task = asyncio.create_task(self.writer.run(), name="stream-writer")
        self._loop = asyncio.get_running_loop()
        if self.settings.watchdog_s > 0:
            self.watchdog = Watchdog(self.settings.watchdog_s, self._give_back_from_thread)
        try:
            await check_orchestrator_mode(self.client, self.names, self.pipeline)
            if self.replaces is not None:  # its slots now, not once their leases lapsed
                await self.leases.release_dead(self.replaces)
            slot = await self.leases.take_lowest_free()
            self.home = await self._serve(slot, home=True)
            loops = [
                asyncio.create_task(self._keep_leases(), name="leases"),
                asyncio.create_task(self._watch(), name="watch"),
            ]
            if self.watchdog is not None:
                loops.append(asyncio.create_task(self._tick(self.watchdog), name="tick"))
                self.watchdog.start()
            follower = asyncio.create_task(self._follow_releases(), name="released-slots")
            self.ready.set()
            log.info(
                "orchestrator of %r ready (%s mode, slot %d)",
                self.pipeline.name,
                self.pipeline.mode,
                slot,
            )
            ended = asyncio.create_task(stop.wait())
            await asyncio.wait([ended, *loops], return_when=asyncio.FIRST_COMPLETED)
            ended.cancel()
            crashed = [t for t in loops if t.done() and not t.cancelled() and t.exception()]
            await self._shut_down(loops, follower)
            if crashed:  # a loop died: fail loudly (a supervisor restarts the process)
                raise cast(BaseException, crashed[0].exception())
        finally:
            if self.watchdog is not None:  # the service may end with its process going on
                self.watchdog.stop()
            await cancel_and_wait([writer_task])
            self.obs.close()
            await self.client.aclose()
        if self.deposed is not None:
            raise self.deposed

    async def _shut_down(
        self, loops: list[asyncio.Task[None]], follower: asyncio.Task[None]
    ) -> None:
        """Stop the loops and slots, write what was queued, give the slots back (a live
        process takes over their requests in flight at once)."""
        self._stopping.set()
        self._look_now.set()
        for served in self.slots.values():
            served.stop_reading()  # at once: a request a cut read got stays pending
        await cancel_and_wait([follower])  # its read blocks for seconds: not waited out
        await asyncio.wait(loops, timeout=self.settings.block_ms / 1000 + 5.0)
        await cancel_and_wait(loops)
        for served in self.slots.values():
            await served.stop()
        with contextlib.suppress(RedisError):  # its row in `status` goes with it
            await self.client.delete(self.watch.own_heartbeat)
        if self.deposed is not None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FLUSH_TIMEOUT_S):
                await self.writer.written()
        with contextlib.suppress(RedisError):
            for slot in list(self.leases.held):
                await self.leases.release(slot)
            if not await self.leases.others_alive():
                await self.client.delete(self.names.orchestrator_heartbeat())

    def _not_ready(self) -> str | None:
        """`/ready`: why this process serves no slot now, or None."""
        if self._stopping.is_set() or self.deposed is not None:
            return "stopping"
        if self.home is None or not self.ready.is_set():
            return "starting"
        return None if self.leases.fresh() else "lease not renewed in time"

    async def _follow_releases(self) -> None:
        """Wake the lease round whenever a process gives a slot up (`Leases.release`)."""
        block_ms = self.settings.orchestrator_idle_block_ms
        while not self._stopping.is_set():
            try:
                await self.leases.follow_releases(self._look_now.set, block_ms)
            except RedisError as e:  # the lease round still finds lapsed slots on its own
                log.warning("following released slots failed: %r", e)
                await pause(self._stopping, self.settings.orchestrator_lease_ttl_s / 4)

    async def _tick(self, watchdog: Watchdog) -> None:
        """The event loop's own progress: a loop blocked by a call that never returns
        stops every task of the process at once, whatever each had in hand."""
        progress = watchdog.watch(Progress("the orchestrator's event loop"))
        while not self._stopping.is_set():
            progress.beat()
            await pause(self._stopping, watchdog.limit_s / 4)

    def _give_back_from_thread(self, _stuck: list[Stuck]) -> None:
        """The watchdog's last act (on its thread): give the leases back, so that a live
        process takes the slots over at once; if the event loop cannot (it is the one
        wedged), the leases lapse after their TTL instead."""
        if self._loop is None:
            return
        done = asyncio.run_coroutine_threadsafe(self._give_back(), self._loop)
        try:
            done.result(GIVE_BACK_S)
        except (concurrent.futures.TimeoutError, RedisError, OSError) as e:
            log.error("the leases could not be given back (%r): they lapse on their own", e)

    async def _give_back(self) -> None:
        for served in self.slots.values():
            served.stop_reading()
        with contextlib.suppress(TimeoutError):  # what the slots had written goes out first
            async with asyncio.timeout(FLUSH_TIMEOUT_S / 2):
                await self.writer.written()
        self.leases.shut()
        for slot in list(self.leases.held):
            await self.leases.release(slot)
        log.error("orchestrator slots given back; exiting")

    async def _serve(self, slot: int, home: bool) -> SlotService:
        served = SlotService(self.shared, slot, home)
        self.slots[slot] = served
        if self.watchdog is not None:
            self.watchdog.watch(served.progress)
        await served.start()
        return served

    async def _keep_leases(self) -> None:
        """Renew the leases every quarter TTL, and at once when a slot was given up; take
        over lapsed slots; give idle ones back."""
        interval = self.settings.orchestrator_lease_ttl_s / 4
        while not self._stopping.is_set():
            self._look_now.clear()
            try:
                await self._take_over_lapsed(await self.leases.refresh())
                await self._give_back_idle()
            except LeaseLost as e:
                log.error("deposed: %s; stopping", e)
                self.deposed = e
                return
            except RedisError as e:
                log.warning("renewing the orchestrator leases failed: %r", e)
            await pause(self._look_now, interval)

    async def _take_over_lapsed(self, known: set[int] | None) -> None:
        for slot in await self.leases.lapsed(known):
            noticed = time.monotonic()
            if not await self._worth_taking(slot) or not await self.leases.take(slot):
                continue
            try:
                served = await self._serve(slot, home=False)
            except (RedisError, OSError):  # give it back for the next round (or another)
                log.exception("taking over orchestrator slot %d failed", slot)
                await self._drop_slot(slot)
                continue
            restored = len(served.core.request_states)
            took_s = time.monotonic() - noticed
            self.takeovers.append((slot, restored, took_s))
            self.metrics.inc("omni_orchestrator_takeovers_total")
            log.warning(
                "took over orchestrator slot %d: %d requests restored in %.2fs",
                slot,
                restored,
                took_s,
            )

    async def _worth_taking(self, slot: int) -> bool:
        """A lapsed slot matters if it owns requests or has requests read but not handled."""
        if await self.client.hlen(self.names.orchestrator_states(slot)):
            return True
        pending = await self.client.xpending_range(
            self.names.requests,
            keys.ORCHESTRATOR_GROUP,
            min="-",
            max="+",
            count=1,
            consumername=keys.orchestrator_consumer(slot),
        )
        return bool(pending)

    async def _give_back_idle(self) -> None:
        for slot, served in list(self.slots.items()):
            if served is self.home or not served.idle:
                continue
            await self._drop_slot(slot)
            log.info("orchestrator slot %d finished and given back", slot)

    async def _drop_slot(self, slot: int) -> None:
        served = self.slots.pop(slot, None)
        if served is not None:
            if self.watchdog is not None:
                self.watchdog.forget(served.progress)
            await served.stop()
            await self.writer.written()  # its last states (deletions) are in Redis
            served.store.detach()
        await self.leases.release(slot)

    async def _watch(self) -> None:
        """A full look once per heartbeat interval; in between, while requests are in
        flight, the stages every quarter interval (a dead stage fails them sooner).
        Idle, one wake per interval: nothing in flight waits on the stages."""
        loop = asyncio.get_running_loop()
        interval = self.settings.heartbeat_interval_s
        while not self._stopping.is_set():
            try:
                await self.watch.once(loop.time())
                next_look = loop.time() + interval
                while (left := next_look - loop.time()) > 0 and not self._stopping.is_set():
                    await pause(
                        self._stopping, min(left, interval / 4) if self.watch.busy() else left
                    )
                    if self.watch.busy() and next_look - loop.time() > interval / 8:
                        await self.watch.stages(loop.time())
            except RedisError as e:
                log.warning("watching heartbeats failed: %r", e)
                self.watch.unreachable(loop.time())
                await pause(self._stopping, interval)

    async def _recheck_stages(self) -> None:
        await self.watch.stages(asyncio.get_running_loop().time())


def _wedge_after() -> int | None:
    value = os.environ.get(TEST_WEDGE_AFTER, "").strip()
    return int(value) if value.isdigit() else None
