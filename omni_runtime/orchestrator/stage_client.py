"""`RedisStageClient`: one stage of the pipeline, as the orchestrator sees it, over Redis Streams.

`submit` queues an XADD on the stage's input stream through the process's one
`StreamWriter`; `get_output` reads the stage's output stream with the kit's
`GroupReader` (backlog first, malformed entries dead-lettered). An entry may carry
several outputs (a worker batches each round trip's); it is acknowledged only once
the orchestrator handled every output in it (`output_handled`). Inputs are built as
`StageInputOut` (made from `StageInputMsg`), without the model's validation: every
field is the orchestrator's own (the worker validates them as `StageInputMsg`).

One client serves one orchestrator slot: its inputs name the slot as their owner,
so workers answer on the slot's own output stream, read with the slot's consumer
name. `handled_seq` is, per request, the next output seq not yet handled: what a
durable state records, so whoever restores the request drops what was handled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis

from omni_runtime import keys
from omni_runtime.core.types import StageFailure, StageOutput, TokenUsage
from omni_runtime.observe.start import Observability
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.joint_read import JointRead
from omni_runtime.redis_io.liveness import Fence
from omni_runtime.redis_io.streams import GroupReader, entry_fields
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import outgoing
from omni_runtime.wire.messages import AbortMsg
from omni_runtime.wire.outgoing import StageInputOut
from omni_runtime.wire.views import StageOutputRelayView, StageOutputView

log = logging.getLogger(__name__)


class SeqFilter:
    """Drops the outputs a re-run repeats: per request, the next `seq` expected.

    A replica that takes over a dead one's request re-runs it from the start, so
    its first outputs repeat seqs already seen. The expectation outlives the
    stage's `finished` (a late repeat after it is still a repeat) and is forgotten
    when the orchestrator forgets the request, so memory follows live requests.
    Errors always pass: they end the request whatever their seq.
    """

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._next

    def accept(self, msg: StageOutputView) -> bool:
        expected = self._next.get(msg.request_id, 0)
        if msg.seq < expected and msg.error is None:
            return False
        self._next[msg.request_id] = max(expected, msg.seq + 1)
        return True

    def forget(self, request_id: str) -> None:
        self._next.pop(request_id, None)

    def expect(self, request_id: str, seq: int) -> None:
        """Outputs below `seq` were handled before (a restored request): repeats now."""
        self._next[request_id] = max(seq, self._next.get(request_id, 0))


class RedisStageClient:
    """The SPEC §2 stage protocol over Redis, and a `ManagedStage` (acks, aborts, quiesce)."""

    def __init__(
        self,
        client: aioredis.Redis,
        writer: StreamWriter,
        stage_id: int,
        names: keys.Names,
        *,
        read_count: int,
        block_ms: int,
        max_message_bytes: int,
        streaming: bool = False,
        relay: bool = False,
        obs: Observability | None = None,
        backoff: Backoff | None = None,
        slot: int = 0,
        fence: Fence | None = None,
        block_budget: Callable[[], int] | None = None,
        joint: JointRead | None = None,
    ) -> None:
        self.writer = writer
        self.stage_id = stage_id
        self.slot = slot
        self.fence = fence
        self.in_stream = names.stage_in(stage_id)
        self.out_stream = names.stage_out(stage_id, slot)
        self.control = names.control
        self.read_count = read_count
        self.block_ms = block_ms
        self.streaming = streaming
        self.obs = obs or Observability()
        """Its counters; the tracer of the moment and the requests traced on demand (their
        inputs carry the flag to the workers), read at each use."""
        self.metrics = self.obs.metrics
        # Relayed (streaming: nothing is forwarded): data kept as read, checked, not decoded.
        view = StageOutputRelayView if relay else StageOutputView
        self.reader: GroupReader[StageOutputView] = GroupReader(
            client,
            self.out_stream,
            keys.ORCHESTRATOR_GROUP,
            keys.orchestrator_consumer(slot),
            view,
            max_bytes=max_message_bytes,
            dead_letters=names.dead_letters,
            metrics=self.metrics,
            backoff=backoff,
            block_budget=block_budget,
            batches=True,
            joint=joint,
        )
        self.seq = SeqFilter()
        self.handled_seq: dict[str, int] = {}
        self._entry_of: dict[int, tuple[bytes, str, int]] = {}
        """id(output) → (entry, request, seq), from `get_output` to `output_handled`."""
        self._unhandled: dict[bytes, int] = {}
        """entry → its outputs not handled yet: acknowledged when none is left."""
        self._stopping = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def malformed_entries(self) -> int:
        return int(self.metrics.value("omni_malformed_entries_total", stream=self.out_stream))

    @property
    def duplicate_outputs(self) -> int:
        return int(self.metrics.value("omni_duplicate_outputs_total", stage=self.stage_id))

    async def submit(
        self, request_id: str, data: Any, params: dict[str, Any] | None = None
    ) -> None:
        if (tracer := self.obs.tracer) is not None:
            tracer.stamp("input_submitted", request_id, self.stage_id)
        trace = request_id in self.obs.traced
        msg = StageInputOut(
            request_id=request_id,
            trace=trace,
            data=data,
            streaming=self.streaming,
            owner=self.slot,
            params=params or None,
        )
        fields = {keys.PAYLOAD_FIELD: outgoing.encode(msg)}  # bad data raises here
        trace_id = (request_id, self.stage_id)
        self.writer.xadd(self.in_stream, fields, urgent=True, trace=trace_id, owner=request_id)

    async def abort(self, request_id: str) -> None:
        """Broadcast on the control stream: whichever worker holds the request drops it."""
        msg = entry_fields(AbortMsg(request_id=request_id))
        self.writer.xadd(self.control, msg, max_age_s=keys.CONTROL_STREAM_AGE_S)

    async def quiesce(self, timeout_s: float = 5.0) -> None:
        """Stop reading now: the blocking read in progress is cut short (what it was
        delivered stays pending, read again as backlog by the next orchestrator)."""
        self._stopping = True
        self.reader.interrupt()
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            log.warning("stage %d reader still busy after %.1fs", self.stage_id, timeout_s)

    def request_ended(self, request_id: str) -> None:
        self.seq.forget(request_id)
        self.handled_seq.pop(request_id, None)

    def restore(self, request_id: str, next_seq: int) -> None:
        """A restored request: its outputs below `next_seq` were handled already."""
        self.seq.expect(request_id, next_seq)
        self.handled_seq[request_id] = next_seq

    async def get_output(self) -> list[StageOutput]:
        while True:
            stopped = self._stopping or self.reader.interrupted  # (a joint read's, too)
            if stopped or (self.fence is not None and not await self.fence.hold()):
                await asyncio.get_running_loop().create_future()  # parked until cancelled
            self._idle.clear()
            try:
                batch = await self.reader.read(self.read_count, self.block_ms)
            finally:
                self._idle.set()
            outputs = self._accept(batch)
            if outputs:
                if (tracer := self.obs.tracer) is not None:
                    for out in outputs:
                        tracer.stamp("output_returned", out.request_id, self.stage_id)
                return outputs

    def output_handled(self, out: StageOutput) -> None:
        entry = self._entry_of.pop(id(out), None)
        if entry is None:
            log.warning(
                "stage %d: no entry for the handled output of %r",
                self.stage_id,
                out,
                extra={"request_id": out.request_id},
            )
            return
        entry_id, rid, seq = entry
        if rid in self.seq:  # still live (an ended request forgot its seqs)
            self.handled_seq[rid] = max(seq + 1, self.handled_seq.get(rid, 0))
        left = self._unhandled.pop(entry_id, 1) - 1
        if left > 0:
            self._unhandled[entry_id] = left
        else:
            self.writer.xack(self.out_stream, keys.ORCHESTRATOR_GROUP, entry_id, delete=True)

    def _accept(self, batch: list[tuple[bytes, StageOutputView]]) -> list[StageOutput]:
        outputs: list[StageOutput] = []
        taken: dict[bytes, int] = {}  # entry → its outputs accepted now (repeats are not)
        for entry_id, msg in batch:
            taken.setdefault(entry_id, 0)
            if not self.seq.accept(msg):
                self.metrics.inc("omni_duplicate_outputs_total", stage=self.stage_id)
                continue
            taken[entry_id] += 1
            if msg.error:
                data: Any = StageFailure(
                    f"stage {self.stage_id} failed: {msg.error}", msg.error_code
                )
            elif isinstance(msg.data, msgspec.Raw):  # its own bytes: held till the request
                data = msg.data.copy()  # ends, it must not keep the whole read batch alive
            else:
                data = msg.data
            out = StageOutput(
                msg.request_id,
                data,
                msg.finished or msg.error is not None,
                msg.finish_reason,
                TokenUsage.read(msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens),
            )
            self._entry_of[id(out)] = (entry_id, msg.request_id, msg.seq)
            outputs.append(out)
            if (tracer := self.obs.tracer) is not None:
                tracer.stamp("output_read", msg.request_id, self.stage_id, self.reader.read_ns)
        for entry_id, n in taken.items():
            if n:
                self._unhandled[entry_id] = self._unhandled.get(entry_id, 0) + n
            else:  # nothing in it to handle: done with now
                self.writer.xack(self.out_stream, keys.ORCHESTRATOR_GROUP, entry_id, delete=True)
        return outputs
