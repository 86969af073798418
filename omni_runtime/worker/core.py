"""A stage worker's decisions, with no I/O and no threads of its own.

The process shell (`proc.py`) feeds it what its I/O threads delivered, lets it drive
the engine (`step`, `tick`) and carries out the `Actions` it hands back. Every rule of
a request's life on a worker — one final per request, per-request output sequence
numbers, an abort beats a late input, a silent upstream times out, a failing engine
fails only the requests it concerns — lives here, testable with no Redis. Its hands on
the engine, which start a failed step engine over, are `driver.EngineDriver`'s.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised
from omni_runtime.core.types import request_finals
from omni_runtime.errors import CodecError
from omni_runtime.logs import for_request as _rid
from omni_runtime.observe.metrics import Metrics
from omni_runtime.stage_api import ChunkStream, EngineOutput, StageEngine
from omni_runtime.wire import codec, outgoing
from omni_runtime.wire.messages import clip_error
from omni_runtime.wire.outgoing import StageOutputOut
from omni_runtime.worker.actions import Actions, ActiveRequest, Input, Outgoing, Ownership
from omni_runtime.worker.driver import EngineDriver
from omni_runtime.worker.poison import POISON_STRIKES

log = logging.getLogger(__name__)

MODES = ("sequential", "streaming")  # by `streaming`; an input in the other mode fails
CHUNK_ENVELOPE_BYTES = len(codec.encode({"data": None, "finished": False})) - 1
"""What a chunk (`core.chunk_book.Chunk`) adds to its data's encoded bytes."""
ABORT_MEMORY_S, ABORT_MEMORY_MAX = 60.0, 10_000
"""Aborted ids are remembered (to drop their late inputs) this long, and at most this many."""


class WorkerCore:
    """Owns the worker's active requests and drives its engine (see the module docstring)."""

    def __init__(
        self,
        engine: StageEngine,
        stage_id: int,
        stage_name: str,
        *,
        sends_chunks: bool,
        receives_chunks: bool,
        max_message_bytes: int,
        input_timeout_s: float,
        metrics: Metrics,
        reports_outputs: bool = True,
        abort_memory_s: float = ABORT_MEMORY_S,
        abort_memory_max: int = ABORT_MEMORY_MAX,
        rebuild: Callable[[], StageEngine] | None = None,
        poison_strikes: int = POISON_STRIKES,
        final_stage_ids: frozenset[int] = frozenset(),
        audio_stage: int | None = None,
    ) -> None:
        self.driver = EngineDriver(
            engine, stage_id, stage_name, metrics, rebuild=rebuild, poison_strikes=poison_strikes
        )
        self.stage_id = stage_id
        self.stage_name = stage_name
        self.sends_chunks = sends_chunks
        self._finals = final_stage_ids
        self._audio_stage = audio_stage
        self.receives_chunks = receives_chunks
        self.max_message_bytes = max_message_bytes
        self.input_timeout_s = input_timeout_s
        self.metrics = metrics
        self.reports_outputs = reports_outputs
        """False for a streaming stage that is not a final one: the orchestrator needs only
        its end (or error), so its other outputs are not sent and its end carries no data."""
        self._stage = str(stage_id)
        self._abort_memory_s = abort_memory_s
        self._abort_memory_max = abort_memory_max
        self._active: dict[str, ActiveRequest] = {}
        self._recent_aborts: OrderedDict[str, float] = OrderedDict()
        self._actions = Actions()
        self._last_check: Ownership | None = None
        """The latest ownership snapshot: an input read before a stall may arrive after it."""

    @property
    def engine(self) -> StageEngine:
        """The engine now: a reset may have built a new one (`driver`)."""
        return self.driver.engine

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def held_entries(self) -> list[bytes]:
        """The input entries of the requests running here (a drain hands them back)."""
        return [req.entry_id for req in self._active.values()]

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    @property
    def remembered_aborts(self) -> int:
        return len(self._recent_aborts)

    def take_actions(self) -> Actions:
        actions, self._actions = self._actions, Actions()
        return actions

    def on_input(self, inp: Input, now: float) -> None:
        """Start a request; a redelivery of one running here, or of an aborted one, is acked.
        Whatever raises while taking it fails that request alone (one error output)."""
        try:
            self._on_input(inp, now)
        except Exception as e:  # one input's failure, of any kind, fails that request alone
            self._contain(inp.msg.request_id, "taking its input", e, inp.entry_id)

    def _contain(self, rid: str, what: str, e: Exception, entry_id: bytes | None) -> None:
        """An exception while handling one request: it ends with one error output, counted
        and logged; the worker goes on."""
        self.metrics.inc("omni_contained_errors_total", where=f"worker {what}")
        log.error("stage %d: %s failed: %r", self.stage_id, what, e, exc_info=e, extra=_rid(rid))
        error = f"stage {self.stage_id} internal error: {type(e).__name__}: {e}"
        if rid in self._active:
            self._fail(rid, error)
        elif entry_id is not None:  # never started here: answered and acked all the same
            self.metrics.inc("omni_requests_failed_total", stage=self._stage)
            self._publish_error(rid, error, 0, entry_id)
            self._actions.freed_slots += 1

    def _on_input(self, inp: Input, now: float) -> None:
        rid, refused = inp.msg.request_id, inp.refused
        if refused is None and inp.msg.streaming != self.receives_chunks:
            refused = (
                f"the orchestrator runs {MODES[inp.msg.streaming]} mode, this worker of stage "
                f"{self._stage} runs {MODES[self.receives_chunks]}: start both with the same --mode"
            )
        if refused is not None and rid not in self._active:
            self.metrics.inc("omni_requests_failed_total", stage=self._stage)
            self._publish_error(rid, refused, 0, inp.entry_id)
            self._actions.freed_slots += 1
            return
        check = self._last_check
        if check and not inp.taken_over and check.lost(inp.entry_id):  # read before a stall
            self.metrics.inc("omni_deposed_requests_total", stage=self._stage)
            self._actions.freed_slots += 1
            return
        if rid in self._active or rid in self._recent_aborts:
            running = self._active.get(rid)
            # its own entry read again (a failed read walks the backlog) stays pending until
            # the request ends, for a takeover should this worker die; a repeat is acked
            if running is None or running.entry_id != inp.entry_id:
                self._actions.acks.append(inp.entry_id)
            self._actions.freed_slots += 1
            return
        req = ActiveRequest(inp.entry_id, now, sends_chunks=self._sends_chunks_for(inp.msg.params))
        data = inp.msg.data
        if inp.msg.streaming and self.receives_chunks:
            req.stream = data = ChunkStream(prompt=data)  # streaming sends every stage the prompt
            self._actions.receiver_loads.append(rid)
        self._active[rid] = req
        error = self.driver.add(rid, data, inp.msg.params)
        if error is not None:
            self._fail(rid, error)

    def _sends_chunks_for(self, params: Mapping[str, Any] | None) -> bool:
        """A sending stage sends nothing for a request that ends here: one that wants no
        audio ends before the audio stage (`core.types.request_finals`), as the
        orchestrator runs it."""
        if not self.sends_chunks or self._audio_stage is None:
            return self.sends_chunks
        return self.stage_id < max(request_finals(self._finals, self._audio_stage, params))

    def on_abort(self, request_id: str, now: float) -> None:
        """Drop the request: engine, chunk sender and receiver, its input entry. A receiving
        stage also discards a request whose input has not arrived: nobody would read its
        upstream's chunks, which would then wait for their TTL."""
        first = request_id not in self._recent_aborts
        self._recent_aborts[request_id] = now
        self._recent_aborts.move_to_end(request_id)
        while len(self._recent_aborts) > self._abort_memory_max:
            self._recent_aborts.popitem(last=False)
        req = self._active.pop(request_id, None)
        if req is None:
            if first and self.receives_chunks:
                self._actions.discards.append(request_id)
            return
        self.driver.drop(request_id, abort=True)
        self._actions.discards.append(request_id)
        self._actions.acks.append(req.entry_id)
        self._actions.freed_slots += 1
        self.metrics.inc("omni_aborts_total", reason="aborted", stage=self._stage)

    def on_ownership(self, ownership: Ownership) -> list[str]:
        """Drop, unpublished, the requests whose input another replica claimed while this
        one stalled; returns their ids, so their queued writes go too."""
        self._last_check = ownership
        lost = [rid for rid, req in self._active.items() if ownership.lost(req.entry_id)]
        for rid in lost:
            del self._active[rid]
            self.driver.drop(rid, abort=True)
            if self.receives_chunks:  # locally only: the chunk keys are the new owner's now
                self._actions.receiver_cleanups.append(rid)
            self._actions.freed_slots += 1
            self.metrics.inc("omni_deposed_requests_total", stage=self._stage)
            log.warning(
                "stage %d: input claimed by another replica", self.stage_id, extra=_rid(rid)
            )
        return lost

    def on_chunks(self, ready: Mapping[str, Sequence[Mapping[str, Any]]], now: float) -> bool:
        """Hand received chunks (`{req: [{"data", "finished"}, ...]}`) to their requests."""
        for rid, chunks in ready.items():
            req = self._active.get(rid)
            if req is None or req.stream is None or not chunks:
                continue
            req.last_input_at = now
            try:
                data, closed = [c["data"] for c in chunks], bool(chunks[-1]["finished"])
            except (KeyError, TypeError) as e:  # not a chunk as a sender writes one
                self._contain(rid, "taking its chunks", e, None)
                continue
            extended = foreign.call(req.stream.extend, data, closed)  # tells stage code's
            if isinstance(extended, Raised):  # listeners: a failure fails that request alone
                self._contain(rid, "taking its chunks", extended.error, None)
        return bool(ready)

    def on_publish_failed(self, lost: Sequence[Outgoing], reason: str) -> None:
        """Outputs the shell could not write: their requests end with an error output now."""
        by_request: dict[str, list[Outgoing]] = {}
        for out in lost:
            by_request.setdefault(out.request_id, []).append(out)
        error = f"stage {self.stage_id} output lost: {reason}"
        for rid, outs in by_request.items():
            if any(o.is_error for o in outs):  # its error final was lost too: nothing left
                log.error("stage %d: error output lost: %s", self.stage_id, reason, extra=_rid(rid))
                continue
            if rid in self._active:
                self._fail(rid, error)
                continue
            # It ended already: its final went into the lost batch or was skipped after it.
            self.metrics.inc("omni_requests_failed_total", stage=self._stage)
            log.error("stage %d: request failed: %s", self.stage_id, error, extra=_rid(rid))
            ack = next((o.ack for o in outs if o.ack is not None), None)
            self._publish_error(rid, error, max(o.seq for o in outs) + 1, ack)

    def step(self) -> bool:
        """Step the engine if it has work; True if that produced outputs or failures (or
        started the engine over: the next step comes at once)."""
        stepped = self.driver.step()
        if stepped is None:
            return False
        for rid, error in stepped.failed:
            if rid in self._active:
                self._fail(rid, error)
        for out in stepped.outputs:
            self._emit(out)
        return bool(stepped.outputs or stepped.failed or stepped.again)

    def tick(self, now: float) -> None:
        """Housekeeping: fail requests whose upstream went silent, forget old aborts."""
        limit = self.input_timeout_s
        stalled = [
            rid
            for rid, req in self._active.items()
            if req.stream is not None and not req.stream.closed and now - req.last_input_at > limit
        ]
        error = f"no input from stage {self.stage_id - 1} within {limit:g}s (OMNI_INPUT_TIMEOUT_S)"
        for rid in stalled:
            self._fail(rid, error)
        horizon = now - self._abort_memory_s
        while self._recent_aborts and next(iter(self._recent_aborts.values())) < horizon:
            self._recent_aborts.popitem(last=False)

    def _emit(self, out: EngineOutput) -> None:
        """One engine output: encode it (or turn it into the request's error), publish it.

        Its data is encoded once, here: the bytes go into the output the orchestrator
        reads and, as they are, into the chunk the next stage reads. What cannot travel
        fails the request here, a chunk the orchestrator will not see too."""
        rid = out.request_id
        req = self._active.get(rid)
        if req is None:
            return  # aborted or failed meanwhile
        is_error = out.error is not None
        ends = out.finished or is_error
        reported = is_error or self.reports_outputs  # else its chunks carry it on (SPEC §6)
        payload = b""
        try:
            data = codec.encode_raw(out.data)
            if reported:
                payload = _encode_output(rid, data, out.finished, out.error, req.seq, out)
            size = len(payload) if reported else len(data) + CHUNK_ENVELOPE_BYTES
            if size > self.max_message_bytes:  # the reader would refuse it
                raise CodecError(f"{size} bytes > OMNI_MAX_MESSAGE_BYTES")
        except CodecError as e:
            log.error("stage %d: output cannot be sent: %s", self.stage_id, e, extra=_rid(rid))
            self._fail(rid, f"output cannot be sent: {e}", abort_engine=not ends)
            return
        if is_error:
            self._actions.discards.append(rid)
        elif req.sends_chunks:
            self._actions.chunk_saves.append((rid, data, out.finished))
        if not reported:
            if not ends:
                req.seq += 1
                return
            payload = _encode_output(rid, None, True, None, req.seq, out)
        ack = req.entry_id if ends else None
        self._actions.outputs.append(Outgoing(rid, req.seq, payload, ends, is_error, ack))
        req.seq += 1
        if ends:
            self._end(rid, failed=is_error)

    def _publish_error(self, rid: str, error: str, seq: int, ack: bytes | None) -> None:
        payload = _encode_output(rid, None, True, error, seq)
        self._actions.outputs.append(Outgoing(rid, seq, payload, True, True, ack))

    def _fail(self, rid: str, error: str, abort_engine: bool = True) -> None:
        """End an active request with one error output; the engine stops working on it."""
        req = self._active[rid]
        log.error("stage %d: request failed: %s", self.stage_id, error, extra=_rid(rid))
        self._actions.discards.append(rid)
        self._publish_error(rid, error, req.seq, req.entry_id)
        self._end(rid, failed=True, abort_engine=abort_engine)

    def _end(self, rid: str, failed: bool, abort_engine: bool = False) -> None:
        del self._active[rid]
        self.driver.drop(rid, abort=abort_engine)
        if self.receives_chunks:
            self._actions.receiver_cleanups.append(rid)
        self._actions.freed_slots += 1
        self.metrics.inc("omni_requests_completed_total", stage=self._stage)
        if failed:
            self.metrics.inc("omni_requests_failed_total", stage=self._stage)


def _encode_output(
    rid: str,
    data: Any,
    finished: bool,
    error: str | None,
    seq: int,
    out: EngineOutput | None = None,
) -> bytes:
    """A `StageOutputMsg`'s wire bytes, built as its `StageOutputOut`: no model per output
    (the reader validates it). `out` adds what the engine said of its end: the refusal's
    code, and on a finished output why it ended and its token counts."""
    error = None if error is None else clip_error(error)
    ending = out if out is not None and finished else None
    usage = None if ending is None else ending.usage
    msg = StageOutputOut(
        request_id=rid,
        data=data,
        finished=finished,
        error=error,
        seq=seq,
        error_code=None if out is None else out.error_code,
        finish_reason=None if ending is None else ending.finish_reason,
        prompt_tokens=None if usage is None else usage.prompt_tokens,
        completion_tokens=None if usage is None else usage.completion_tokens,
        cached_tokens=None if usage is None else usage.cached_tokens,
    )
    return outgoing.encode(msg)
