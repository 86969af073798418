"""The asyncio client: submit prompts, stream back their outputs, abort.

Each client owns one output stream (`<ns>:client:<client id>`) that the
orchestrator writes every output of this client's requests to; one reader
task fans them out to per-request queues. The stream expires if the client
goes away, and is deleted when it closes.

Every request ends with one final at the client, whatever Redis and the orchestrators do:
the client keeps each request's deadline too, and ends one still waiting past it (plus
`OMNI_DEADLINE_GRACE_S`) itself, saying what it knows (`client_deadlines`). A submission
Redis refuses for memory fails at once (`RedisOutOfMemoryError`), never written later.
Redis restarted empty ends nothing here: its orchestrator's error final or its deadline do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from omni_runtime import keys
from omni_runtime.client.inbox import IdleWait, Inbox
from omni_runtime.client.playback import Playback, audio_seconds
from omni_runtime.core.tasks import cancel_and_wait
from omni_runtime.core.types import OrchOutput
from omni_runtime.errors import (
    CodecError,
    RedisOutOfMemoryError,
    RequestTimeoutError,
    StartupTimeoutError,
    TransportError,
)
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.start import Observability, ObserveSettings
from omni_runtime.pipeline import OutputsConfig
from omni_runtime.redis_io.backoff import RetrySettings
from omni_runtime.redis_io.client_deadlines import ClientDeadlines, RedisCondition
from omni_runtime.redis_io.clients import REDIS_FAILURES, RedisClients, is_cluster
from omni_runtime.redis_io.entries import parse_entries
from omni_runtime.redis_io.liveness import StateEpoch, stage_has_live_replica
from omni_runtime.redis_io.raw_reads import AsyncHeldReads
from omni_runtime.redis_io.streams import DeadLetters, entry_fields
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.settings import Settings
from omni_runtime.wire import codec, views
from omni_runtime.wire.messages import AbortMsg, checked_request

__all__ = ["OmniClient", "RequestTimeoutError"]

log = logging.getLogger(__name__)

READY_POLL_S = 0.02
"""`wait_ready` checks the heartbeats this often: a few cheap commands, once per start."""


class OmniClient:
    def __init__(
        self,
        settings: Settings,
        clients: RedisClients | None = None,
        client_id: str | None = None,
        metrics: Metrics | None = None,
        outputs: OutputsConfig | None = None,
    ) -> None:
        self.settings = settings
        self.outputs = outputs
        """The pipeline's audio stage and rate: with one, `stream` measures playback gaps."""
        self.names = settings.names
        self.clients = clients or RedisClients.connect(
            settings.redis_url, settings.redis_cluster, settings.namespace
        )
        self.client_id = client_id or uuid.uuid4().hex
        self.out_stream = self.names.client_out(self.client_id)
        self._reader: asyncio.Task[None] | None = None
        self._reader_failed: str | None = None  # why the output reader died (a bug)
        self._closing = False
        self.obs = Observability(metrics)
        """Its counters and tracers (started on entry); `metrics` may be shared with
        other clients of one process (the HTTP front door's)."""
        self.observe = settings.part(ObserveSettings)
        self.retry = settings.part(RetrySettings)
        self.metrics = self.obs.metrics
        self.inbox = Inbox(self.metrics, settings.client_buffer_outputs)
        self.redis_condition = RedisCondition()
        """What this client last learned of Redis (unreachable, out of memory)."""
        self._deadlines = ClientDeadlines(settings.deadline_grace_s, self.redis_condition)
        self._refused: dict[str, TransportError] = {}
        """request id → why its submission was given up (the writer's `on_failed`)."""
        self._deadline_task: asyncio.Task[None] | None = None
        self._errorstats = True
        """Redis's count of refused writes is read with each beat (`INFO errorstats`)."""

    @property
    def out_of_memory(self) -> str | None:
        """What Redis said, while it refuses this client's writes for memory (`/ready`)."""
        return self.redis_condition.out_of_memory

    @property
    def dropped_outputs(self) -> int:
        """Outputs dropped: malformed, or for a request this client no longer waits for."""
        return int(self.metrics.value("omni_dropped_outputs_total", source="client"))

    async def __aenter__(self) -> OmniClient:
        codec.warm_up()
        self.obs.start(self.observe, "client", self.clients.sync, serve=False)
        self.redis: aioredis.Redis = self.clients.aio()
        self._errorstats = not is_cluster(self.redis)  # INFO of which node?
        self._reads = AsyncHeldReads(self.redis)  # this client's output reads, by hand
        self._writer = StreamWriter(
            self.redis,
            self.settings.stream_maxlen,
            obs=self.obs,
            backoff=self.retry.backoff(bounded=True),
            hold_refused=False,  # a refused submission fails at once
            on_failed=self._write_failed,
        )
        self._writer_task = asyncio.create_task(self._writer.run(), name="client-writer")
        self._heartbeat_key = self.names.client_heartbeat(self.client_id)
        self._epoch = StateEpoch(self.redis, self.names.epoch)
        self._dead = DeadLetters(self.redis, self.names.dead_letters, metrics=self.metrics)
        await self._beat()
        self._reader = asyncio.create_task(self._read_outputs(), name="client-reader")
        self._reader.add_done_callback(self._reader_ended)
        ending = self._deadlines.run(self._deadline_passed)
        self._deadline_task = asyncio.create_task(ending, name="client-deadlines")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop reading (within one `block_ms`, no command cut off midway), drop the stream.

        asyncio.run cancels every task at once on Ctrl-C, this client's reader and writer with
        the rest: neither is waited for then, and the aborts it queues are dropped (counted):
        the orchestrator ends those requests once this client's heartbeat lapses."""
        for request_id in list(self.inbox.requests):  # nobody will read them: free the pipeline
            self._abort_upstream(request_id, "aborted")
        if self._reader is not None:
            self._closing = True
            await asyncio.wait({self._reader}, timeout=self.settings.block_ms / 1000 + 5)
            await cancel_and_wait([self._reader])
            self._reader = None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await self._writer.flushed()
            await cancel_and_wait([self._writer_task])
        if self._deadline_task is not None:
            await cancel_and_wait([self._deadline_task])
            self._deadline_task = None
        with contextlib.suppress(RedisError):
            await self.redis.delete(self.out_stream, self._heartbeat_key)
        await self.redis.aclose()
        self.obs.close()

    async def wait_ready(self, stage_ids: list[int], timeout_s: float | None = None) -> None:
        """Wait until the orchestrator and a worker of every listed stage beat their heartbeat."""
        timeout_s = timeout_s or self.settings.startup_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            missing: list[str] = []
            if not await self.redis.exists(self.names.orchestrator_heartbeat()):
                missing.append("orchestrator")
            for sid in stage_ids:
                if not await stage_has_live_replica(self.redis, self.names, sid):
                    missing.append(f"stage {sid} worker")
            if not missing:
                return
            if loop.time() > deadline:
                raise StartupTimeoutError(
                    f"not ready after {timeout_s:g}s: no {', '.join(missing)} (raise OMNI_"
                    "STARTUP_TIMEOUT_S, or check that they use the same Redis and namespace)"
                )
            await asyncio.sleep(READY_POLL_S)

    async def submit(
        self,
        prompt: Any,
        request_id: str | None = None,
        deadline_s: float | None = None,
        trace: bool = False,
        params: dict[str, Any] | None = None,
    ) -> str:
        """Send a request (outputs queue up until `stream`); `trace`: record its timeline;
        `params`: what every stage receives (`docs/stages.md`). Raises `RedisOutOfMemoryError`
        at once while Redis refuses writes for memory, `TransportError` if it was not sent."""
        started = asyncio.get_running_loop().time()  # the request's deadline counts from here
        if self._reader_failed is not None:
            raise TransportError(f"this client can read no answer: {self._reader_failed}")
        request_id = request_id or uuid.uuid4().hex
        obs = self.obs
        if (tracer := obs.tracer or (obs.on_demand if trace else None)) is not None:
            tracer.stamp("client_submitted", request_id)
        msg = checked_request(
            request_id=request_id,
            client_id=self.client_id,
            prompt=prompt,
            deadline_s=deadline_s,
            trace=trace,
            params=params or None,
        )
        if deadline_s is not None and deadline_s > self.settings.max_deadline_s:
            raise CodecError(f"deadline_s={deadline_s:g} exceeds OMNI_MAX_DEADLINE_S")
        fields = entry_fields(msg)
        size = len(fields[keys.PAYLOAD_FIELD])
        if size > self.settings.max_message_bytes:
            raise CodecError(f"request of {size} bytes exceeds OMNI_MAX_MESSAGE_BYTES")
        self.inbox.open(request_id)
        self._writer.xadd(self.names.requests, fields, urgent=True, owner=request_id)
        self._writer.send_now()  # at once with no round trip in flight, else in the next one
        written = await self._writer.written()  # False: this write, or another, was not
        refused = self._refused.pop(request_id, None)
        if refused is not None or (not written and self._writer.stopped):
            self.inbox.requests.pop(request_id, None)
            if isinstance(refused, RedisOutOfMemoryError):
                self.metrics.inc("omni_requests_refused_total", reason="redis out of memory")
                raise RedisOutOfMemoryError(f"{refused}; request {request_id!r} not submitted")
            why = refused or "the client is closing"
            raise TransportError(f"request {request_id!r} could not be sent to Redis: {why}")
        self.redis_condition.room()  # an XADD went through
        self._deadlines.add(request_id, deadline_s or self.settings.deadline_s, started)
        return request_id

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        msg = AbortMsg(request_id=request_id, reason=reason)
        self._writer.xadd(self.names.requests, entry_fields(msg))
        await self._writer.written()

    async def stream(
        self, request_id: str, timeout_s: float | None = None
    ) -> AsyncIterator[OrchOutput]:
        """The request's outputs as they arrive, up to and including the finished one."""
        pending = self.inbox.requests.get(request_id)
        if pending is None:
            raise KeyError(f"request {request_id!r} was not submitted by this client")
        timeout_s = timeout_s or self.settings.request_timeout_s
        finished = False
        audio = self.outputs if self.outputs and self.outputs.audio_stage is not None else None
        playback = Playback()
        clock = asyncio.get_running_loop().time
        waiter = IdleWait(pending, timeout_s)
        try:
            while True:
                out = await waiter.next()
                if out is None:
                    raise RequestTimeoutError(
                        f"no output for request {request_id!r} within {timeout_s:g}s "
                        "(OMNI_REQUEST_TIMEOUT_S)"
                    )
                finished = out.finished
                if audio is not None and out.stage_id == audio.audio_stage:
                    playback.add(clock(), audio_seconds(out.data, audio.sample_rate))
                yield out
                if finished:
                    return
        finally:
            waiter.close()
            self._deadlines.cancel(request_id)
            if finished and playback.started_at is not None:
                self.metrics.observe("omni_audio_gap_seconds", playback.worst_gap_s)
            self.inbox.close(request_id, asyncio.get_running_loop().time())
            if not finished:  # abandoned (break, timeout, cancel): stop the work it causes
                self._abort_upstream(request_id, "aborted")

    async def generate(self, prompt: Any, **kwargs: Any) -> AsyncIterator[OrchOutput]:
        """`submit` then `stream`."""
        request_id = await self.submit(prompt, **kwargs)
        async for out in self.stream(request_id):
            yield out

    async def _beat(self) -> None:
        """Refresh the heartbeat, in one round trip with a look at the epoch. Redis out of
        memory refuses the SET, not the PEXPIRE: the key lives on (the orchestrator must
        not take this client for gone), and the refusal tells the client Redis is full.
        Redis back empty: outputs are read from the new stream's start; nothing ends here."""
        ttl_ms = self.settings.heartbeat_ttl_ms
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self._heartbeat_key, 1, px=ttl_ms)
            pipe.pexpire(self._heartbeat_key, ttl_ms)
            pipe.get(self.names.epoch)
            if self._errorstats:
                pipe.info("errorstats")
            beat, _kept, seen, *stats = await pipe.execute(raise_on_error=False)
        now = asyncio.get_running_loop().time()
        if isinstance(beat, RedisError):
            self.metrics.inc("omni_redis_oom_refusals_total", source="client heartbeat")
        self._errorstats &= self.redis_condition.beat(beat, stats, now)
        if isinstance(seen, RedisError):
            raise seen
        if await self._epoch.lost_given(seen):
            self.redis_condition.restarted_at = now
            waiting = len(self.inbox.requests)
            log.error("Redis restarted empty: %d requests wait for answers or deadlines", waiting)
            self._last_id = b"0-0"

    async def _read_outputs(self) -> None:
        self._last_id = b"0-0"
        s, backoff = self.settings, self.retry.backoff()
        beat_at = 0.0
        loop = asyncio.get_running_loop()
        read: list[bytes] = []  # read once, so deleted (with the next read, in its send)
        while not self._closing:
            try:
                if loop.time() >= beat_at:
                    beat_at = loop.time() + self.settings.heartbeat_interval_s
                    await self._beat()
                streams = {self.out_stream: self._last_id}
                batch = await self._reads.xread(streams, s.read_count, s.block_ms, read)
                read = []
                backoff.succeeded()
                self.redis_condition.reachable()
            except REDIS_FAILURES as e:  # retried (a bug ends it: `_reader_ended`)
                if isinstance(e, RedisConnectionError | RedisTimeoutError):
                    self.redis_condition.unreachable(e, loop.time())
                delay_s = backoff.failed() or 0.0
                log.warning("reading outputs failed, retrying in %.2fs: %r", delay_s, e)
                self.metrics.inc("omni_retries_total", stream=self.out_stream)
                await asyncio.sleep(delay_s)
                continue
            ids: list[bytes] = []
            for _stream, entries in batch:
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    ids.append(entry_id)
                    await self._deliver(entry_id, fields)
            if ids:
                read = ids
                await asyncio.sleep(0)  # the consumers have what came before the next read

    def end_all(self, reason: str) -> int:
        """End every request in flight now with `reason` as its error final, each aborted
        at every stage (`serve` at the end of its drain); how many it ended."""
        ended = self.inbox.end_all(reason, asyncio.get_running_loop().time())
        for request_id in ended:
            self._abort_upstream(request_id, reason)
        return len(ended)

    def _reader_ended(self, task: asyncio.Task[None]) -> None:
        """The reader retries Redis's failures; if a bug ends it, the requests in flight end
        now and `submit` refuses, rather than wait out their deadlines unread."""
        if task.cancelled() or (error := task.exception()) is None:
            return
        why = self._reader_failed = f"its output reader failed: {error!r}"
        log.error("client %s: %s", self.client_id, why, exc_info=error)
        self.end_all(why)

    async def _deliver(self, entry_id: bytes, fields: Any) -> None:
        try:
            msgs = parse_entries(fields, views.OrchOutputView, self.settings.max_message_bytes)
        except CodecError as e:
            self.metrics.inc("omni_malformed_entries_total", stream=self.out_stream)
            await self._dead.send(self.out_stream, None, entry_id, str(e), fields)
            return
        now = asyncio.get_running_loop().time()
        for msg in msgs:
            error = self.inbox.deliver(msg, now)
            if error is not None:
                rid = msg.request_id
                log.error(
                    "request %r ended by the client: %s", rid, error, extra={"request_id": rid}
                )
                self._abort_upstream(rid, error)

    def _write_failed(self, request_ids: list[str], error: TransportError) -> None:
        """The writer gave up on writes of these requests (submissions: `submit` raises)."""
        if isinstance(error, RedisOutOfMemoryError):
            now = asyncio.get_running_loop().time()
            self.redis_condition.refused_for_memory(str(error), now)
        for rid in request_ids:
            if rid in self.inbox.requests:
                self._refused[rid] = error

    def _deadline_passed(self, request_id: str, error: str) -> None:
        """No final by the request's deadline and grace: the client ends it itself."""
        now = asyncio.get_running_loop().time()
        if self.inbox.end(request_id, 0, error, now) is None:
            return  # it had ended
        self.metrics.inc("omni_deadline_exceeded_total", source="client")
        log.error("request %r ended by the client: %s", request_id, error)
        self._abort_upstream(request_id, error)

    def _abort_upstream(self, request_id: str, reason: str) -> None:
        """The client gave up on the request: free the pipeline of its work."""
        msg = AbortMsg(request_id=request_id, reason=reason[:200])
        self._writer.xadd(self.names.requests, entry_fields(msg))
