"""A stage worker process: one scheduler loop around the stage's engine.

I/O threads hand off to the loop through in-memory queues and one wake-up
Event, so the loop never blocks on Redis: an input-reader thread does the
blocking XREADGROUP, the ChunkAdapter's threads move chunks (streaming
mode), a heartbeat thread keeps the worker visible and re-claims the inputs
of replicas whose heartbeat expired. Each loop iteration: take new inputs,
feed received chunks, step the engine, publish outputs in one pipeline.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from omni_runtime import codec, keys
from omni_runtime.chunks.adapter import ChunkAdapter
from omni_runtime.chunks.redis import RedisConnector
from omni_runtime.errors import CodecError
from omni_runtime.messages import StageInputMsg, StageOutputMsg
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.stage_client import (
    dead_letter_fields,
    ensure_group_sync,
    entry_fields,
    parse_entry,
    xadd_fields,
)
from omni_runtime.settings import Settings
from omni_runtime.stage_api import ChunkStream, EngineOutput
from omni_runtime.tracing import tracer_for
from omni_runtime.worker.engines import load_engine
from omni_runtime.worker.io_threads import ControlReader, Heartbeat, InputReader

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL_S = 0.05
"""How often the loop checks for stalled inputs, at the latest."""
IDLE_LOOP_WAIT_S = 1.0
"""With no request in flight the loop sleeps until woken (inputs, aborts), at most this long."""
ABORT_MEMORY_S = 60.0


@dataclass
class ActiveRequest:
    entry_id: bytes
    stream: ChunkStream | None = None
    seq: int = 0
    last_input_at: float = field(default_factory=time.monotonic)


class StageWorker:
    def __init__(
        self,
        pipeline: PipelineConfig,
        stage_id: int,
        settings: Settings,
        clients: RedisClients | None = None,
        worker_id: str | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.stage = pipeline.stage(stage_id)
        self.stage_id = stage_id
        self.settings = settings
        self.clients = clients or RedisClients.from_url(settings.require_redis_url())
        self.names = settings.names
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.streaming = pipeline.mode == "streaming"
        self.sends_chunks = self.streaming and stage_id < pipeline.last_stage
        self.receives_chunks = self.streaming and stage_id > 0
        self.in_stream = self.names.stage_in(stage_id)
        self.out_stream = self.names.stage_out(stage_id)
        self.wake = threading.Event()
        self.stop_event = threading.Event()
        self.active: dict[str, ActiveRequest] = {}
        self.completed = 0
        self.aborted = 0
        self.malformed_inputs = 0
        self.recent_aborts: dict[str, float] = {}
        """Aborted request ids (bounded, ~1 min): an input that arrives after its abort is dropped."""
        self._next_housekeeping = 0.0
        self.tracer = tracer_for(settings.trace_file)

    # --- lifecycle -------------------------------------------------------------

    def run(self) -> None:
        """Serve until `stop()`; then finish in-flight requests for a short while and exit."""
        s = self.settings
        codec.warm_up()
        self.client = self.clients.sync()
        ensure_group_sync(self.client, self.in_stream, keys.WORKERS_GROUP)
        self.engine = load_engine(
            self.stage, self.pipeline.source_dir, s.worker_max_concurrency, self.wake.set
        )
        self.adapter: ChunkAdapter | None = None
        if self.streaming:
            self.connector = RedisConnector(
                self.client, ttl_s=s.chunk_ttl_s, prefix=self.names.chunk_prefix
            )
            self.adapter = ChunkAdapter(self.connector, self.stage_id, on_ready=self.wake.set)
        self.reader = InputReader(self, self.client)
        self.control = ControlReader(self, self.client)
        self.heartbeat = Heartbeat(self, self.client)
        self.heartbeat.start()
        self.control.start()  # before inputs: an abort is never older than what it aborts
        self.reader.start()
        log.info("worker %s of stage %d (%s) ready", self.worker_id, self.stage_id, self.stage.name)
        try:
            self._loop()
        finally:
            self.reader.stop()
            self.control.stop()
            self.heartbeat.stop()
            if self.adapter is not None:
                self.adapter.stop()
                self.connector.close()
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()
            self.client.close()
            log.info(
                "worker %s of stage %d stopped: %d requests completed, %d aborted, "
                "%d still active, %d malformed inputs",
                self.worker_id,
                self.stage_id,
                self.completed,
                self.aborted,
                len(self.active),
                self.malformed_inputs,
            )

    def stop(self) -> None:
        self.stop_event.set()
        self.wake.set()

    def free_slots(self) -> int:
        return self.settings.worker_max_concurrency - len(self.active)

    # --- the scheduler loop ----------------------------------------------------

    def _loop(self) -> None:
        drain_deadline: float | None = None
        while True:
            if self.stop_event.is_set():
                drain_deadline = drain_deadline or time.monotonic() + 5.0
                if not self.active or time.monotonic() > drain_deadline:
                    return
            self.wake.clear()
            self._take_aborts()
            busy = self._take_inputs()
            busy |= self._feed_chunks()
            outputs = self.engine.step() if self.engine.has_work() else []
            if outputs:
                self._publish(outputs)
            if time.monotonic() >= self._next_housekeeping:
                self._next_housekeeping = time.monotonic() + HOUSEKEEPING_INTERVAL_S
                self._expire_stalled_inputs()
                self._forget_old_aborts()
            if not outputs and not busy:
                self.wake.wait(HOUSEKEEPING_INTERVAL_S if self.active else IDLE_LOOP_WAIT_S)

    def _take_aborts(self) -> None:
        """Drop aborted requests: engine, chunk sender and receiver, their chunk keys, the input."""
        now = time.monotonic()
        for rid in self.control.take():
            self.recent_aborts[rid] = now
            req = self.active.pop(rid, None)
            if req is None:
                continue
            self.engine.abort(rid)
            if self.adapter is not None:
                self.adapter.discard(rid)
            self._ack(req.entry_id)
            self.aborted += 1
            self.reader.slots_freed()

    def _forget_old_aborts(self) -> None:
        horizon = time.monotonic() - ABORT_MEMORY_S
        for rid in [r for r, t in self.recent_aborts.items() if t < horizon]:
            del self.recent_aborts[rid]

    def _ack(self, entry_id: bytes) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            pipe.xack(self.in_stream, keys.WORKERS_GROUP, entry_id)
            self._execute(pipe)

    def _take_inputs(self) -> bool:
        entries = self.reader.take()
        for entry_id, fields in entries:
            try:
                msg = parse_entry(fields, StageInputMsg, self.settings.max_message_bytes)
            except CodecError as e:
                self._dead_letter(entry_id, fields, str(e))
                continue
            if msg.request_id in self.active or msg.request_id in self.recent_aborts:
                self._ack(entry_id)  # a redelivery of what we run, or already aborted
                continue
            req = ActiveRequest(entry_id)
            self.active[msg.request_id] = req
            data = msg.data
            if msg.streaming and self.receives_chunks and self.adapter is not None:
                req.stream = data = ChunkStream()
                self.adapter.load_async(msg.request_id)
            self.engine.add_request(msg.request_id, data)
        return bool(entries)

    def _feed_chunks(self) -> bool:
        if self.adapter is None or not self.receives_chunks:
            return False
        ready = self.adapter.poll_ready()
        now = time.monotonic()
        for rid, chunks in ready.items():
            req = self.active.get(rid)
            if req is None or req.stream is None:
                continue
            req.last_input_at = now
            req.stream.extend([c["data"] for c in chunks], closed=chunks[-1]["finished"])
        return bool(ready)

    def _expire_stalled_inputs(self) -> None:
        """An upstream that never sends its next chunk fails the request instead of hanging it."""
        limit = self.settings.input_timeout_s
        now = time.monotonic()
        stalled = [
            rid
            for rid, req in self.active.items()
            if req.stream is not None and not req.stream.closed and now - req.last_input_at > limit
        ]
        for rid in stalled:
            self.engine.abort(rid)
            error = (
                f"no input from stage {self.stage_id - 1} within {limit:g}s (OMNI_INPUT_TIMEOUT_S)"
            )
            self._publish([EngineOutput(rid, None, True, error=error)])

    # --- output ----------------------------------------------------------------

    def _publish(self, outputs: list[EngineOutput]) -> None:
        """One pipeline: every output entry, and the acks of the inputs they finished."""
        finished: list[tuple[str, ActiveRequest]] = []
        chunks: list[EngineOutput] = []
        with self.client.pipeline(transaction=False) as pipe:
            for out in outputs:
                req = self.active.get(out.request_id)
                if req is None:
                    continue  # aborted meanwhile
                fields, out = self._encode_output(out, req.seq)
                req.seq += 1
                pipe.xadd(
                    self.out_stream,
                    xadd_fields(fields),
                    maxlen=self.settings.stream_maxlen,
                    approximate=True,
                )
                if self.adapter is not None:
                    if out.error is not None:  # final with data None if mid-stream, keys deleted
                        self.adapter.discard(out.request_id)
                    elif self.sends_chunks:
                        chunks.append(out)
                if out.finished or out.error is not None:
                    pipe.xack(self.in_stream, keys.WORKERS_GROUP, req.entry_id)
                    finished.append((out.request_id, req))
            self._execute(pipe)
        # Chunks for the next stage after the outputs for the user: the SAVE thread's put then
        # does not compete with this round trip (time to first output), and costs ~0.1 ms here.
        if self.adapter is not None:
            for out in chunks:
                self.adapter.save_async(out.request_id, out.data, out.finished)
        for rid, _req in finished:
            self.active.pop(rid, None)
            if self.adapter is not None and self.receives_chunks:
                self.adapter.cleanup_receiver(rid)
            self.completed += 1
        if finished:
            self.reader.slots_freed()

    def _encode_output(self, out: EngineOutput, seq: int) -> tuple[dict[str, bytes], EngineOutput]:
        """The entry for `out`; an output that cannot travel becomes the request's error
        (and the engine stops working on it)."""
        msg = StageOutputMsg(
            request_id=out.request_id,
            data=out.data,
            finished=out.finished,
            error=out.error,
            seq=seq,
        )
        try:
            fields = entry_fields(msg)
            size = len(fields[keys.PAYLOAD_FIELD])
            if size > self.settings.max_message_bytes:  # the reader would refuse it
                raise CodecError(f"{size} bytes > OMNI_MAX_MESSAGE_BYTES")
            return fields, out
        except CodecError as e:
            log.error("stage %d output for %r cannot be sent: %s", self.stage_id, out.request_id, e)
            if not out.finished and out.error is None:
                self.engine.abort(out.request_id)
            failed = EngineOutput(out.request_id, None, True, error=f"output cannot be sent: {e}")
            bad = StageOutputMsg(
                request_id=out.request_id, data=None, finished=True, seq=seq, error=failed.error
            )
            return entry_fields(bad), failed

    def _execute(self, pipe: Any) -> None:
        delay_s = 0.01
        while True:
            try:
                pipe.execute()
                return
            except RedisError as e:
                if self.stop_event.is_set() and delay_s > 1:
                    log.error("dropping a batch of outputs on shutdown: %r", e)
                    return
                log.warning("publishing outputs failed, retrying in %.2fs: %r", delay_s, e)
                time.sleep(delay_s)
                delay_s = min(2.0, delay_s * 2)

    def _dead_letter(self, entry_id: bytes, fields: Any, error: str) -> None:
        self.malformed_inputs += 1
        log.error("malformed entry %s on %s dead-lettered: %s", entry_id, self.in_stream, error)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.xadd(
                self.names.dead_letters,
                xadd_fields(dead_letter_fields(self.in_stream, entry_id, error, fields)),
                maxlen=keys.DEAD_LETTER_MAXLEN,
                approximate=True,
            )
            pipe.xack(self.in_stream, keys.WORKERS_GROUP, entry_id)
            self._execute(pipe)
