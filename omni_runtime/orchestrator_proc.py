"""The orchestrator process: the very SPEC §3 Orchestrator, wired to Redis streams.

It reads client requests, runs them through the pipeline with one
`RedisStageClient` per stage up to the last final one, and delivers each
`OrchOutput` to the stream of the client that asked. It beats a heartbeat key so
clients and the local runner know it is up.
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
from omni_runtime.messages import AbortMsg, ClientCommand, OrchOutputMsg, RequestMsg
from omni_runtime.metrics import Metrics
from omni_runtime.pipeline import PipelineConfig, resolve_entry
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.stage_client import RedisStageClient
from omni_runtime.redis_io.streams import GroupReader, ensure_group, entry_fields
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.settings import Settings
from omni_runtime.tracing import tracer_for

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
        self.client = (clients or RedisClients.from_url(s.require_redis_url())).aio()
        self.tracer = tracer_for(s.trace_file)
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
        self.client_of: dict[str, str] = {}
        """request id → client id, for the requests in flight."""
        self.ready = asyncio.Event()
        self._stopping = asyncio.Event()

    @property
    def malformed_requests(self) -> int:
        return int(self.metrics.value("omni_malformed_entries_total", stream=self.names.requests))

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then flush what was queued and close."""
        codec.warm_up()
        try:
            for stream in [self.names.requests, *(st.out_stream for st in self.stages)]:
                await ensure_group(self.client, stream, keys.ORCHESTRATOR_GROUP)
            writer_task = asyncio.create_task(self.writer.run(), name="stream-writer")
            async with self.orchestrator:
                redis_loops = [
                    asyncio.create_task(self._read_requests(), name="requests"),
                    asyncio.create_task(self._heartbeat(), name="heartbeat"),
                    asyncio.create_task(self._watch_clients(), name="clients"),
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
            await self.client.aclose()

    async def _stop_loops(
        self, redis_loops: list[asyncio.Task[None]], delivery: asyncio.Task[None]
    ) -> None:
        """Redis loops end after their current command; then everything left is cancelled
        (delivery waits on in-memory queues only)."""
        self._stopping.set()
        timeout_s = self.settings.block_ms / 1000 + SHUTDOWN_GRACE_S
        await asyncio.wait(redis_loops, timeout=timeout_s)
        tasks = [*redis_loops, delivery]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _read_requests(self) -> None:
        s = self.settings
        while not self._stopping.is_set():
            for entry_id, cmd in await self.requests.read(s.read_count, s.block_ms):
                if isinstance(cmd, RequestMsg):
                    if self.tracer is not None:
                        self.tracer.stamp(
                            "request_read", cmd.request_id, None, self.requests.read_ns
                        )
                    self.client_of[cmd.request_id] = cmd.client_id
                    await self.orchestrator.add_request(cmd.request_id, cmd.prompt, cmd.deadline_s)
                else:
                    await self.orchestrator.abort_request(cmd.request_id, cmd.reason)
                # Acknowledged once queued, as before: the handler task, woken first, queues
                # the stage input before the writer task takes this ack.
                self.writer.xack(self.names.requests, keys.ORCHESTRATOR_GROUP, entry_id)

    async def _watch_clients(self) -> None:
        """Abort the requests of clients whose heartbeat expired: nobody will read them."""
        while not self._stopping.is_set():
            await self._pause(self.settings.heartbeat_interval_s)
            client_ids = sorted(set(self.client_of.values()))
            if not client_ids:
                continue
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    for cid in client_ids:
                        pipe.exists(self.names.client_heartbeat(cid))
                    alive = await pipe.execute()
            except RedisError as e:
                log.warning("checking client heartbeats failed: %r", e)
                continue
            gone = {cid for cid, ok in zip(client_ids, alive, strict=True) if not ok}
            for rid, cid in list(self.client_of.items()):
                if cid in gone:
                    await self.orchestrator.abort_request(rid, "client went away")

    async def _deliver_outputs(self) -> None:
        ttl_s = self.settings.client_stream_ttl_s
        while True:
            out: OrchOutput = await self.orchestrator.next_output()
            if self.writer.urgent_pending:
                await asyncio.sleep(0)  # let the writer send a stage's next input first
            client_id = self.client_of.get(out.request_id)
            if out.finished:
                self.client_of.pop(out.request_id, None)
            if client_id is None:
                log.warning("output for %r has no client; dropped", out.request_id)
                continue
            msg = OrchOutputMsg(
                request_id=out.request_id,
                stage_id=out.stage_id,
                data=out.data,
                finished=out.finished,
                error=out.error,
            )
            stream = self.names.client_out(client_id)
            self.writer.xadd(stream, entry_fields(msg))
            self.writer.expire(stream, ttl_s)

    async def _heartbeat(self) -> None:
        key = self.names.orchestrator_heartbeat()
        while not self._stopping.is_set():
            try:
                await self.client.set(key, self.pipeline.name, ex=keys.HEARTBEAT_TTL_S)
            except RedisError as e:
                log.warning("heartbeat failed: %r", e)
            await self._pause(self.settings.heartbeat_interval_s)

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once on shutdown: loops end between commands, never inside one."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
