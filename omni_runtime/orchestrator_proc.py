"""The orchestrator process: the very SPEC §3 Orchestrator, wired to Redis streams.

It reads client requests, runs them through the pipeline with one `RedisStageClient`
per stage up to the last final one, and delivers each `OrchOutput` to the stream of the
client that asked. It beats a heartbeat key so clients and the local runner see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from pydantic import TypeAdapter
from redis.exceptions import RedisError

from omni_runtime import codec, keys
from omni_runtime.core.orchestrator import Orchestrator
from omni_runtime.core.streaming import StreamingOrchestrator
from omni_runtime.core.types import OrchOutput, Stage, forward_previous_data
from omni_runtime.messages import REDIS_LOST_STATE, AbortMsg, ClientCommand, RequestMsg
from omni_runtime.metrics import Metrics
from omni_runtime.observe.on_demand import FINISHED, TraceSwitch
from omni_runtime.observe.start import start_observability
from omni_runtime.observe.timings import RequestTimer
from omni_runtime.pipeline import PipelineConfig, resolve_entry
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.liveness import (
    Absence,
    StageWatch,
    StateEpoch,
    no_live_worker,
    stage_has_live_replica,
)
from omni_runtime.redis_io.outbox import ClientOutbox
from omni_runtime.redis_io.stage_client import RedisStageClient
from omni_runtime.redis_io.streams import GroupReader, ensure_group
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.settings import Settings
from omni_runtime.tracing import Tracer

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
"""How long, beyond one blocking read, the Redis loops get to end on their own at shutdown."""
FLUSH_TIMEOUT_S = 2.0


def build_orchestrator(
    pipeline: PipelineConfig,
    stages: Sequence[Stage],
    default_deadline_s: float | None = None,
    metrics: Metrics | None = None,
) -> Orchestrator:
    """The orchestrator class of the pipeline's mode, with its forward function."""
    forward = (
        resolve_entry(pipeline.forward, pipeline.source_dir)
        if pipeline.forward
        else forward_previous_data
    )
    cls = StreamingOrchestrator if pipeline.mode == "streaming" else Orchestrator
    return cls(stages, pipeline.final_stage_ids, forward, default_deadline_s, metrics)


class OrchestratorService:
    """One orchestrator process: built whole here, served by `run` (once)."""

    def __init__(
        self,
        pipeline: PipelineConfig,
        settings: Settings,
        clients: RedisClients | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        s = settings
        self.pipeline = pipeline
        self.settings = settings
        self.names = s.names
        self.metrics = metrics or Metrics()
        self.clients = clients or RedisClients.from_settings(s)
        self.client = self.clients.aio()
        self.tracer: Tracer | None = None
        """Set in `run`, with the rest of the observability (`OMNI_TRACE_FILE`, `OMNI_TRACE`)."""
        backoff = s.backoff(bounded=True)
        self.writer = StreamWriter(
            self.client, s.stream_maxlen, self.tracer, metrics=self.metrics, backoff=backoff
        )
        self.stages = [
            RedisStageClient(
                self.client,
                self.writer,
                sid,
                self.names,
                read_count=s.read_count,
                block_ms=s.block_ms,
                max_message_bytes=s.max_message_bytes,
                streaming=pipeline.mode == "streaming" and sid > 0,
                tracer=self.tracer,
                metrics=self.metrics,
                backoff=backoff,
            )
            for sid in range(pipeline.last_stage + 1)
        ]
        self.orchestrator = build_orchestrator(pipeline, self.stages, s.deadline_s, self.metrics)
        self.requests: GroupReader[RequestMsg | AbortMsg] = GroupReader(
            self.client,
            self.names.requests,
            keys.ORCHESTRATOR_GROUP,
            keys.ORCHESTRATOR_CONSUMER,
            TypeAdapter(ClientCommand),
            max_bytes=s.max_message_bytes,
            dead_letters=self.names.dead_letters,
            metrics=self.metrics,
            backoff=backoff,
        )
        self.outbox = ClientOutbox(self.writer, self.names, s.client_stream_ttl_s)
        self.client_of = self.outbox.client_of
        """request id → client id, for the requests in flight."""
        ttl_s = s.heartbeat_ttl_s or float(keys.HEARTBEAT_TTL_S)
        self._clients_absent = Absence(ttl_s)
        self._stage_watch = StageWatch(ttl_s, 0.0)
        self._epoch = StateEpoch(self.client, self.names.epoch)
        self.timer = RequestTimer(self.metrics)
        self.ready = asyncio.Event()
        self._stopping = asyncio.Event()

    @property
    def malformed_requests(self) -> int:
        return int(self.metrics.value("omni_malformed_entries_total", stream=self.names.requests))

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then flush what was queued and close."""
        codec.warm_up()
        self._stage_watch.restarted(asyncio.get_running_loop().time())
        obs = start_observability(
            self.settings, self.metrics, "orchestrator", self.clients.sync, poll_streams=True
        )
        self._traced = TraceSwitch(obs.tracer, obs.on_demand, self._trace_with, self.stages)
        self.metrics.gauge_callback("omni_requests_running", self.timer.running_count)
        try:
            for stream in self._streams():
                await ensure_group(self.client, stream, keys.ORCHESTRATOR_GROUP)
            writer_task = asyncio.create_task(self.writer.run(), name="stream-writer")
            async with self.orchestrator:
                redis_loops = [
                    asyncio.create_task(self._read_requests(), name="requests"),
                    asyncio.create_task(self._watch(), name="watch"),
                ]
                delivery = asyncio.create_task(self._deliver_outputs(), name="deliver")
                self.ready.set()
                log.info(
                    "orchestrator of %r ready (%s mode)", self.pipeline.name, self.pipeline.mode
                )
                await stop.wait()
                await self._stop_loops(redis_loops, delivery)
                for stage in self.stages:
                    await stage.quiesce()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FLUSH_TIMEOUT_S):
                    await self.writer.flushed()
            writer_task.cancel()
            await asyncio.gather(writer_task, return_exceptions=True)
            await self.client.delete(self.names.orchestrator_heartbeat())
        finally:
            obs.close()
            await self.client.aclose()

    def _trace_with(self, tracer: Tracer | None) -> None:
        """Every component stamps through the process's tracer (file, Redis, OpenTelemetry)."""
        self.tracer = self.writer.tracer = tracer
        for stage in self.stages:
            stage.tracer = tracer

    async def _stop_loops(
        self, redis_loops: list[asyncio.Task[None]], delivery: asyncio.Task[None]
    ) -> None:
        """Cut the Redis loops' reads short, then cancel what is left (delivery waits in memory)."""
        self._stopping.set()
        self.requests.interrupt()
        await asyncio.wait(redis_loops, timeout=self.settings.block_ms / 1000 + SHUTDOWN_GRACE_S)
        for task in (tasks := [*redis_loops, delivery]):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _read_requests(self) -> None:
        s = self.settings
        while not self._stopping.is_set():
            batch = await self.requests.read(s.read_count, s.block_ms)
            if batch and self._stage_watch.down:  # a replica may have beaten since
                with contextlib.suppress(RedisError):
                    await self._watch_stages(asyncio.get_running_loop().time())
            for entry_id, cmd in batch:
                if isinstance(cmd, RequestMsg) and cmd.request_id in self.client_of:
                    if self.client_of[cmd.request_id] != cmd.client_id:
                        self.outbox.refuse(cmd.request_id, cmd.client_id, "duplicate request id")
                    # else read again (a lost reply, a retried write): it is in flight
                elif isinstance(cmd, RequestMsg) and self._stage_watch.down:
                    error = no_live_worker(min(self._stage_watch.down))
                    self.metrics.inc("omni_requests_refused_total", reason=error)
                    self.outbox.refuse(cmd.request_id, cmd.client_id, error)
                elif isinstance(cmd, RequestMsg):
                    if cmd.trace:  # traced on demand: this process stamps it too
                        self._traced.begin(cmd.request_id)
                    if self.tracer is not None:
                        self.tracer.stamp(
                            "request_read", cmd.request_id, None, self.requests.read_ns
                        )
                    self.client_of[cmd.request_id] = cmd.client_id
                    self.timer.started(cmd.request_id)
                    await self.orchestrator.add_request(cmd.request_id, cmd.prompt, cmd.deadline_s)
                else:
                    await self.orchestrator.abort_request(cmd.request_id, cmd.reason)
                # Acknowledged once queued, as before: the handler task, woken first, queues
                # the stage input before the writer task takes this ack.
                self.writer.xack(
                    self.names.requests, keys.ORCHESTRATOR_GROUP, entry_id, delete=True
                )

    async def _watch(self) -> None:
        """Once per heartbeat interval: beat, notice a Redis restart, dead stages, gone clients."""
        loop = asyncio.get_running_loop()
        key = self.names.orchestrator_heartbeat()
        while not self._stopping.is_set():
            try:
                await self.client.set(key, self.pipeline.name, px=self.settings.heartbeat_ttl_ms)
                if await self._epoch.lost():
                    await self._redis_restarted(loop.time())
                await self._watch_stages(loop.time())
                await self._watch_clients(loop.time())
            except RedisError as e:
                log.warning("watching heartbeats failed: %r", e)
            await self._pause(self.settings.heartbeat_interval_s)

    async def _redis_restarted(self, now: float) -> None:
        """Redis came back empty: every request in flight lost its inputs and outputs. End
        each with one error at once (none waits for its deadline); groups are recreated."""
        log.error("Redis restarted empty: ending %d requests in flight", len(self.client_of))
        self.metrics.inc("omni_redis_restarts_total")
        for stream in self._streams():
            await ensure_group(self.client, stream, keys.ORCHESTRATOR_GROUP)
        self._clients_absent.reset()
        self._stage_watch.restarted(now)
        for rid in list(self.client_of):
            self.metrics.inc("omni_aborts_total", reason="redis restarted")
            await self.orchestrator.abort_request(rid, REDIS_LOST_STATE)

    async def _watch_stages(self, now: float) -> None:
        live = [
            (sid, await stage_has_live_replica(self.client, self.names, sid))
            for sid in range(len(self.stages))
        ]
        new, back = self._stage_watch.update(live, now)
        for sid in sorted(back):
            log.warning("stage %d has a live worker again", sid)
        for sid in sorted(new):
            log.error("stage %d has no live worker: failing its requests", sid)
            self.metrics.inc("omni_stage_down_total", stage=sid)
            states = self.orchestrator.request_states
            for rid in list(self.client_of):
                state = states.get(rid)
                if state is None or sid not in state.finished:
                    self.metrics.inc("omni_aborts_total", reason="no live worker")
                    await self.orchestrator.abort_request(rid, no_live_worker(sid))

    async def _watch_clients(self, now: float) -> None:
        """Abort the requests of clients gone for longer than the heartbeat TTL: a key
        missing once may just be Redis back empty before the client beat again."""
        client_ids = sorted(set(self.client_of.values()))
        if not client_ids and not len(self._clients_absent):
            return
        async with self.client.pipeline(transaction=False) as pipe:
            for cid in client_ids:
                pipe.exists(self.names.client_heartbeat(cid))
            alive = await pipe.execute()
        present = {cid: bool(ok) for cid, ok in zip(client_ids, alive, strict=True)}
        gone = self._clients_absent.update(present, now)
        for rid, cid in list(self.client_of.items()):
            if cid in gone:
                self.metrics.inc("omni_aborts_total", reason="client went away")
                await self.orchestrator.abort_request(rid, "client went away")

    async def _deliver_outputs(self) -> None:
        while True:
            out: OrchOutput = await self.orchestrator.next_output()
            if self.writer.urgent_pending:
                await asyncio.sleep(0)  # let the writer send a stage's next input first
            self.outbox.send(out)
            if out.finished and self.tracer is not None:
                self.tracer.stamp(FINISHED, out.request_id)
            self.timer.output(out.request_id, out.data, out.finished, out.error)

    def _streams(self) -> list[str]:
        return [self.names.requests, *(st.out_stream for st in self.stages)]

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once on shutdown: loops end between commands, never inside one."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
