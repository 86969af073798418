"""The orchestrator process: the very SPEC §3 Orchestrator, wired to Redis streams.

It reads client requests, runs them through the pipeline with one
`RedisStageClient` per stage, and delivers each `OrchOutput` to the stream of
the client that asked. It beats a heartbeat key so clients and the local
runner know it is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from pydantic import TypeAdapter
from redis.exceptions import RedisError

from omni_runtime import codec, keys
from omni_runtime.core.orchestrator import Orchestrator, forward_previous_data
from omni_runtime.core.types import OrchOutput
from omni_runtime.errors import CodecError
from omni_runtime.messages import AbortMsg, ClientCommand, OrchOutputMsg, RequestMsg
from omni_runtime.pipeline import PipelineConfig, resolve_entry
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.stage_client import (
    RedisStageClient,
    StreamWriter,
    dead_letter_fields,
    ensure_group,
    entry_fields,
    read_group,
)
from omni_runtime.settings import Settings
from omni_runtime.tracing import Tracer, tracer_for

log = logging.getLogger(__name__)

_COMMAND: TypeAdapter[RequestMsg | AbortMsg] = TypeAdapter(ClientCommand)


def build_orchestrator(
    pipeline: PipelineConfig, stages: list[Any], default_deadline_s: float | None = None
) -> Orchestrator:
    """The orchestrator class of the pipeline's mode, with its forward function."""
    forward = (
        resolve_entry(pipeline.forward, pipeline.source_dir)
        if pipeline.forward
        else forward_previous_data
    )
    if pipeline.mode == "streaming":
        from omni_runtime.core.streaming import StreamingOrchestrator

        return StreamingOrchestrator(stages, pipeline.final_stage_ids, forward, default_deadline_s)
    return Orchestrator(stages, pipeline.final_stage_ids, forward, default_deadline_s)


class OrchestratorService:
    def __init__(
        self, pipeline: PipelineConfig, settings: Settings, clients: RedisClients | None = None
    ) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.clients = clients or RedisClients.from_url(settings.require_redis_url())
        self.names = settings.names
        self.client_of: dict[str, str] = {}
        """request id → client id, for the requests in flight."""
        self.malformed_requests = 0
        self._stopping = False
        self._stop_requested = asyncio.Event()
        self.ready = asyncio.Event()
        self.tracer: Tracer | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then flush what was queued and close."""
        s = self.settings
        codec.warm_up()
        client = self.clients.aio()
        tracer = tracer_for(s.trace_file)
        self.tracer = tracer
        writer = StreamWriter(client, s.stream_maxlen, tracer)
        streaming = self.pipeline.mode == "streaming"
        stages = [
            RedisStageClient(
                client,
                writer,
                sid,
                self.names,
                read_count=s.read_count,
                block_ms=s.block_ms,
                max_message_bytes=s.max_message_bytes,
                streaming=streaming and sid > 0,
                tracer=tracer,
            )
            for sid in range(len(self.pipeline.stages))
        ]
        self.orchestrator = build_orchestrator(self.pipeline, stages, s.deadline_s)
        try:
            await ensure_group(client, self.names.requests, keys.ORCHESTRATOR_GROUP)
            for sid in range(len(stages)):
                await ensure_group(client, self.names.stage_out(sid), keys.ORCHESTRATOR_GROUP)
            writer_task = asyncio.create_task(writer.run(), name="stream-writer")
            async with self.orchestrator:
                tasks = [
                    asyncio.create_task(self._read_requests(client, writer), name="requests"),
                    asyncio.create_task(self._deliver_outputs(writer), name="deliver"),
                    asyncio.create_task(self._heartbeat(client), name="heartbeat"),
                    asyncio.create_task(self._watch_clients(client), name="clients"),
                ]
                self.ready.set()
                log.info(
                    "orchestrator of %r ready (%s mode)", self.pipeline.name, self.pipeline.mode
                )
                await stop.wait()
                self._stopping = True  # Redis loops end after their current command
                self._stop_requested.set()
                await asyncio.wait({tasks[0], tasks[2], tasks[3]}, timeout=s.block_ms / 1000 + 5)
                for t in tasks:
                    t.cancel()  # what is left waits on in-memory queues only
                await asyncio.gather(*tasks, return_exceptions=True)
                for stage in stages:
                    await stage.quiesce()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await writer.flushed()
            writer_task.cancel()
            await asyncio.gather(writer_task, return_exceptions=True)
            await client.delete(self.names.orchestrator_heartbeat())
        finally:
            await client.aclose()

    async def _read_requests(self, client: aioredis.Redis, writer: StreamWriter) -> None:
        s = self.settings
        stream = self.names.requests
        start_id = "0"  # first, requests a previous run read but never acknowledged
        while not self._stopping:
            reply = await read_group(
                client,
                stream,
                keys.ORCHESTRATOR_GROUP,
                keys.ORCHESTRATOR_CONSUMER,
                s.read_count,
                s.block_ms,
                start_id,
            )
            t_ns = time.monotonic_ns()
            entries = [entry for _s, batch in reply for entry in batch]
            if start_id != ">":  # walk the backlog by id, then switch to new entries
                start_id = entries[-1][0].decode() if entries else ">"
            for entry_id, fields in entries:
                if fields:  # (a pending entry trimmed since has none)
                    await self._handle_command(writer, stream, entry_id, fields, t_ns)
                writer.xack(stream, keys.ORCHESTRATOR_GROUP, entry_id)

    async def _handle_command(
        self, writer: StreamWriter, stream: str, entry_id: bytes, fields: Any, t_ns: int
    ) -> None:
        try:
            raw = fields.get(keys.PAYLOAD_FIELD.encode())
            if raw is None or len(fields) != 1:
                raise CodecError(f"entry must have exactly the field {keys.PAYLOAD_FIELD!r}")
            cmd = _COMMAND.validate_python(
                codec.decode(raw, max_bytes=self.settings.max_message_bytes)
            )
        except (CodecError, ValueError) as e:
            self.malformed_requests += 1
            log.error("malformed request entry %s dead-lettered: %s", entry_id, e)
            writer.xadd(
                self.names.dead_letters,
                dead_letter_fields(stream, entry_id, str(e), fields),
                keys.DEAD_LETTER_MAXLEN,
            )
            return
        if isinstance(cmd, RequestMsg):
            if self.tracer is not None:
                self.tracer.stamp("request_read", cmd.request_id, None, t_ns)
            self.client_of[cmd.request_id] = cmd.client_id
            await self.orchestrator.add_request(cmd.request_id, cmd.prompt, cmd.deadline_s)
        elif isinstance(cmd, AbortMsg):
            await self.orchestrator.abort_request(cmd.request_id, cmd.reason)

    async def _watch_clients(self, client: aioredis.Redis) -> None:
        """Abort the requests of clients whose heartbeat expired: nobody will read them."""
        while not self._stopping:
            await self._pause(self.settings.heartbeat_interval_s)
            client_ids = sorted(set(self.client_of.values()))
            if not client_ids:
                continue
            try:
                async with client.pipeline(transaction=False) as pipe:
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

    async def _deliver_outputs(self, writer: StreamWriter) -> None:
        ttl_s = self.settings.client_stream_ttl_s
        while True:
            out: OrchOutput = await self.orchestrator.next_output()
            if writer.urgent_pending:
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
            writer.xadd(stream, entry_fields(msg))
            writer.expire(stream, ttl_s)

    async def _heartbeat(self, client: aioredis.Redis) -> None:
        key = self.names.orchestrator_heartbeat()
        while not self._stopping:
            try:
                await client.set(key, self.pipeline.name, ex=keys.HEARTBEAT_TTL_S)
            except RedisError as e:
                log.warning("heartbeat failed: %r", e)
            await self._pause(self.settings.heartbeat_interval_s)

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once on shutdown: loops end between commands, never inside one."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop_requested.wait()
