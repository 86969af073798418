"""The worker's output thread: every write of the scheduler loop, off the loop.

Outputs and acknowledgements queue here and go out as one pipeline per round trip
(whatever accumulated meanwhile). A failed write is retried with the bounded policy
(`RetrySettings.backoff(bounded=True)`): only the commands Redis refused (an entry written
twice would reach the orchestrator twice); a refusal for memory is tried again after a
short delay (`held_writes.PROBE_MAX_S` at most), within the same time in all. Once that
gives up, or Redis refuses an entry for good, the outputs are reported through
`on_lost`, so their requests end with an error instead of being dropped silently, and
later outputs of those requests are skipped until their error output comes through
(a request must never end "successfully" with a chunk missing).

Each request's outputs go to the output stream of the orchestrator slot that owns it
(`StageInputMsg.owner`, recorded by `route` as its input is handed to the core). The
outputs of one round trip for one stream share entries (`output_batch.pack_entries`, up to
`max_batch_bytes` each): one XADD per stream and round trip, however many requests.

When no write is in flight, `publish` sends a small batch from the loop itself on the
thread's held connection (`output_batch`), and the thread only reads its replies; a batch
whose send or replies fail is written again by the thread, after the fence check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import redis
from redis.exceptions import RedisError, ResponseError

from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.held_writes import PROBE_MAX_S
from omni_runtime.redis_io.refusals import Refusal, oom_message, refusal
from omni_runtime.wire import codec
from omni_runtime.worker.actions import Input, Outgoing, Ownership
from omni_runtime.worker.fence import StallFence
from omni_runtime.worker.output_batch import (
    LOOP_SEND_MAX_BYTES,
    HeldConnection,
    OutputBatch,
    OwnerRoutes,
)

log = logging.getLogger(__name__)

FENCE_POLL_S = 0.2
CHECKS_KEPT = 64
"""Ownership checks remembered for batches in hand (one per stall: far more than enough)."""
STOPPING_ATTEMPTS = 3
"""At shutdown a write is tried at most this often: a dead Redis must not hold the exit."""


class OutputThread:
    """XADDs outputs to the stage's output stream and XACKs inputs, in queue order."""

    def __init__(
        self,
        client: redis.Redis,
        out_stream: str,
        in_stream: str,
        *,
        maxlen: int,
        backoff: Callable[[], Backoff],
        on_lost: Callable[[list[Outgoing], str], None],
        metrics: Metrics,
        fence: StallFence | None = None,
        slot_stream: Callable[[int], str] | None = None,
        max_batch_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.client = client
        self.max_batch_bytes = max_batch_bytes
        """What the orchestrator accepts in one entry (`Settings.max_message_bytes`)."""
        self.fence = fence
        self.out_stream = out_stream
        self.routes = OwnerRoutes(slot_stream or (lambda _slot: out_stream))
        self.in_stream = in_stream
        self.maxlen = maxlen
        self.backoff = backoff
        self.on_lost = on_lost
        self.metrics = metrics
        self._cv = threading.Condition()
        self._outputs: list[Outgoing] = []
        self._acks: list[bytes] = []
        self._writing = False
        self._stop = False
        self._lost: set[str] = set()
        """Requests whose outputs were lost; only their error output goes out now."""
        self._checks: deque[tuple[Ownership, set[str]]] = deque(maxlen=CHECKS_KEPT)
        self._check_count = 0
        """Ownership checks applied (`forget`): a batch taken before one is narrowed to
        what is still this replica's before it is written (again)."""
        self._held = HeldConnection.for_client(client)
        self._handed: OutputBatch | None = None
        """A batch the loop took (and sent, if `sent`); the thread finishes it first."""
        self._thread = threading.Thread(target=self._run, name="output-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def route(self, inputs: Sequence[Input]) -> None:
        """Record who owns each request, before any output of it is published."""
        self.routes.record(inputs)

    def publish(self, outputs: list[Outgoing], acks: list[bytes]) -> None:
        """Queue for the next round trip, or send it now if none is in flight; never waits
        for Redis."""
        if not (outputs or acks):
            return
        with self._cv:
            self._outputs.extend(outputs)
            self._acks.extend(acks)
            ahead = bool(outputs) and self._may_send_ahead()
            if ahead:  # the writer is woken once the batch is sent, to read its replies
                taken, self._outputs = self._outputs, []
                taken_acks, self._acks = self._acks, []
                self._writing = True
                checked = self._check_count
            else:
                self._cv.notify_all()
        if ahead:
            self._send_ahead(taken, taken_acks, checked)
        elif outputs:
            # Hand the interpreter lock to the woken writer now: left to the switch
            # interval (5 ms), a busy scheduler would hold every output back that long.
            time.sleep(0)

    def _may_send_ahead(self) -> bool:
        """Under `_cv`: the writer's turn is free and the fence open (else the thread waits)."""
        held = self._held
        return (
            held is not None
            and held.up
            and not (self._writing or self._stop)
            and (self.fence is None or self.fence.fresh())
        )

    def _send_ahead(self, outputs: list[Outgoing], acks: list[bytes], checked: int) -> None:
        """On the loop: route and send the batch; the thread reads the replies (or, if it
        was too big or the send failed, writes it). Whatever happens, the turn is handed
        back: a batch left with the loop would hold every later output."""
        batch: OutputBatch | None = None
        try:
            batch = self._batch(outputs, acks, checked)
            held = self._held
            if held is not None and batch.payload_bytes <= LOOP_SEND_MAX_BYTES:
                commands = batch.pack(self.in_stream, self.maxlen)
                held.send(commands)
                batch.sent = len(commands)
        except Exception as e:  # the writer writes it its usual way
            log.debug("sending outputs from the loop failed, the writer retries: %r", e)
        finally:
            with self._cv:
                if batch is None:  # not even routed: back to the front of the queue
                    self._outputs[:0], self._acks[:0] = outputs, acks
                    self._writing = False
                else:
                    self._handed = batch
                self._cv.notify_all()

    def idle(self) -> bool:
        """Nothing queued and nothing being written."""
        with self._cv:
            return not (self._outputs or self._acks or self._writing)

    def forget(self, request_ids: set[str], ownership: Ownership) -> None:
        """Drop what is queued for inputs another replica claimed (see `fence.py`): the
        requests the scheduler gave up, and those that ended here but whose queued final
        would acknowledge an entry no longer ours."""
        with self._cv:
            self._checks.append((ownership, request_ids))
            self._check_count += 1
            claimed = request_ids | {
                o.request_id for o in self._outputs if o.ack is not None and ownership.lost(o.ack)
            }
            kept = [o for o in self._outputs if o.request_id not in claimed]
            self.metrics.inc("omni_fenced_outputs_total", len(self._outputs) - len(kept))
            self.metrics.inc("omni_deposed_requests_total", len(claimed - request_ids))
            self._outputs = kept
            self._acks = [a for a in self._acks if not ownership.lost(a)]

    def _drop_claimed(self, batch: OutputBatch) -> None:
        """Narrow a batch in hand to what is still this replica's after the ownership checks
        applied since it was taken: a stall between its fence check and its write (the
        write then failed on a connection the claimant closed) must not publish it late."""
        if batch.checked == self._check_count:  # the usual case, read without the lock: a
            return  # check applied meanwhile is seen by the next write (it waits at the fence)
        with self._cv:
            new = min(self._check_count - batch.checked, len(self._checks))
            checks = list(self._checks)[len(self._checks) - new :] if new > 0 else []
            batch.checked = self._check_count
        if not checks:
            return
        given_up = set().union(*(ids for _own, ids in checks))

        def lost(entry_id: bytes) -> bool:
            return any(own.lost(entry_id) for own, _ids in checks)

        claimed = given_up | {o.request_id for o in batch.unwritten if o.ack and lost(o.ack)}
        dropped = batch.drop(claimed, lost)
        self.metrics.inc("omni_fenced_outputs_total", len(dropped))
        self.metrics.inc("omni_deposed_requests_total", len(claimed - given_up))

    def request_stop(self) -> None:
        """Write what is queued, then exit."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            if self._held is not None:
                self._held.close()

    def _serve(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._outputs or self._acks or self._stop or self._handed)
                handed, self._handed = self._handed, None
                if handed is None and not (self._outputs or self._acks):
                    return
            if handed is not None:
                try:
                    self._finish(handed)
                finally:
                    with self._cv:
                        self._writing = False
                continue
            if not self._fence_open():
                return
            with self._cv:
                outputs, self._outputs = self._outputs, []
                acks, self._acks = self._acks, []
                self._writing = True
                checked = self._check_count
            try:
                self._write(self._batch(outputs, acks, checked))
            finally:
                with self._cv:
                    self._writing = False

    def _finish(self, batch: OutputBatch) -> None:
        """A batch the loop took: read its replies, or write it (again) if they failed."""
        if batch.sent and self._held is not None:
            try:
                settled = self._settle(batch, self._held.replies(batch.sent)) is None
                if settled and not batch.next_wave():
                    return
            except RedisError as e:
                self.metrics.inc("omni_retries_total", stream=self.out_stream)
                log.warning("outputs sent from the loop got no reply, writing again: %r", e)
        if not self._fence_open():  # deposed while they were out: never written late
            self.metrics.inc("omni_fenced_outputs_total", len(batch.unwritten))
            return
        self._write(batch)

    def _fence_open(self) -> bool:
        """Wait while the fence is shut (this replica may have stalled past its TTL). At
        shutdown a fence that stays shut drops the queue: unacknowledged, those inputs are
        another replica's to run."""
        while self.fence is not None and not self.fence.wait_writable(FENCE_POLL_S):
            if self._stop:
                with self._cv:
                    log.warning("stopping unfenced: %d outputs not published", len(self._outputs))
                    self.metrics.inc("omni_fenced_outputs_total", len(self._outputs))
                    self._outputs, self._acks = [], []
                return False
        return True

    def _batch(self, outputs: list[Outgoing], acks: list[bytes], checked: int) -> OutputBatch:
        """Routed and packed, without the lost requests' outputs (but their acks)."""
        if self._lost:
            outputs, acks = self._skip_lost(outputs, acks)
        batch = OutputBatch.routed(outputs, acks, self.routes, self.max_batch_bytes)
        batch.checked = checked
        return batch

    def _skip_lost(
        self, outputs: list[Outgoing], acks: list[bytes]
    ) -> tuple[list[Outgoing], list[bytes]]:
        kept: list[Outgoing] = []
        for out in outputs:
            if out.request_id not in self._lost:
                kept.append(out)
            elif out.is_error:
                self._lost.discard(out.request_id)
                kept.append(out)
            elif out.ack is not None:
                acks.append(out.ack)  # its input is done with all the same
        return kept, acks

    def _write(self, batch: OutputBatch) -> None:
        """Write the batch; what Redis refuses, again, alone: for memory after a probe's
        delay, else the policy's, both within the policy's time in all."""
        policy = self.backoff()
        probe = Backoff(policy.initial_s, PROBE_MAX_S)
        give_up_at = time.monotonic() + policy.budget_s()
        while True:
            self._drop_claimed(batch)
            if not batch.left:
                return
            error: RedisError | None
            try:
                error = self._settle(batch, self._round_trip(batch))
            except RedisError as e:  # the round trip failed whole: all of it again
                error = e
            if error is None:
                if batch.next_wave():
                    continue
                return
            if isinstance(error, ResponseError) and refusal(error) is Refusal.OUT_OF_MEMORY:
                self.metrics.inc("omni_redis_oom_refusals_total", source="worker")
                batch.per_request()
                delay = probe.failed() if time.monotonic() < give_up_at else None
            else:
                delay = policy.failed()
            if delay is None or (
                self._stop and policy.failures + probe.failures >= STOPPING_ATTEMPTS
            ):
                self._give_up(batch.unwritten, policy.failures + probe.failures, error)
                return
            self.metrics.inc("omni_retries_total", stream=self.out_stream)
            log.warning("publishing outputs failed, retrying in %.2fs: %r", delay, error)
            time.sleep(delay)
            if not self._fence_open():  # a stall may have come between: held like any write
                self.metrics.inc("omni_fenced_outputs_total", len(batch.unwritten))
                return

    def _round_trip(self, batch: OutputBatch) -> list[object]:
        """Every command's reply, an error reply as its `ResponseError`."""
        if self._held is not None:
            commands = batch.pack(self.in_stream, self.maxlen)
            self._held.send(commands)
            return self._held.replies(len(commands))
        # A cluster pipeline writes its nodes in no order: the acknowledgements go once the
        # entries are in, or a process killed between two nodes' writes loses outputs.
        replies: list[object] = []
        with self.client.pipeline(transaction=False) as pipe:
            if batch.queue_entries(pipe, self.maxlen):
                replies += pipe.execute(raise_on_error=False)
        with self.client.pipeline(transaction=False) as pipe:
            if batch.queue_acks(pipe, self.in_stream):
                replies += pipe.execute(raise_on_error=False)
        return replies

    def _settle(self, batch: OutputBatch, replies: list[object]) -> ResponseError | None:
        """Narrow the batch to what Redis refused; the refusal to retry it for, or None.
        An entry refused for good (a key of the wrong type, an ACL) fails the requests
        whose outputs its stream carried, now; acknowledgements refused for good are let
        go, logged."""
        n = len(batch.entries)
        forever = [
            (e, r)
            for e, r in zip(batch.entries, replies[:n], strict=True)
            if isinstance(r, ResponseError) and _for_good(r)
        ]
        errors = batch.narrow(list(replies))
        if forever:
            gone = {id(e) for e, _r in forever}
            batch.entries = [e for e in batch.entries if id(e) not in gone]
            batch.outputs = [o for e in batch.entries for o in e.outputs]
            self._give_up([o for e, _r in forever for o in e.outputs], 1, forever[0][1])
        if any(_for_good(r) for r in replies[n:]):
            log.error("acknowledging inputs failed for good: %r", replies[n:])
            batch.acked, batch.commands = True, []
        if not batch.entries and (batch.acked or not batch.ack_ids):
            return None
        return next((e for e in errors if not _for_good(e)), None)

    def _give_up(self, outputs: list[Outgoing], attempts: int, e: RedisError) -> None:
        if isinstance(e, ResponseError) and refusal(e) is Refusal.OUT_OF_MEMORY:
            reason = oom_message(e)
        elif isinstance(e, ResponseError) and refusal(e) is Refusal.PERMANENT:
            reason = f"Redis refused the write: {e}"
        else:
            reason = f"Redis unreachable after {attempts} attempts ({type(e).__name__})"
        log.error(
            "dropping %d outputs of stage stream %s: %s", len(outputs), self.out_stream, reason
        )
        self.metrics.inc("omni_dropped_writes_total", stream=self.out_stream)
        self._lost.update(o.request_id for o in outputs if not o.is_error)
        if outputs:
            self.on_lost(outputs, reason)


def _for_good(reply: object) -> bool:
    """An error reply that will come again however often the command is sent."""
    return isinstance(reply, ResponseError) and refusal(reply) is Refusal.PERMANENT
