"""One orchestrator slot served: its requests, its stages' outputs, its durable states.

A slot is what a lease is held on. Its holder reads the requests stream and its
stages' output streams under the slot's consumer name, so whoever serves the slot
next (this process after a restart, or a survivor after a takeover) reads the same
backlog. `start` first restores the slot's durable states into a fresh core
(nothing is submitted again), then reads: a restart and a takeover are one path.

A request's entry is acknowledged only once its state is registered, in the batch
that writes that state; a stage output's, in the batch that records it. The core
hands each user output over synchronously (`sink`), so a state change, the outputs
it causes and its acknowledgement always share one batch of the writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import Sequence
from typing import cast

from redis.exceptions import RedisError

from omni_runtime import keys
from omni_runtime.core.loops import Hooks
from omni_runtime.core.tasks import cancel_and_wait
from omni_runtime.core.types import OrchOutput, ReqState
from omni_runtime.observe.on_demand import FINISHED
from omni_runtime.orchestrator import intake
from omni_runtime.orchestrator.backlog import read_backlog
from omni_runtime.orchestrator.build import build_orchestrator
from omni_runtime.orchestrator.control import ControlGuard
from omni_runtime.orchestrator.outbox import ClientOutbox
from omni_runtime.orchestrator.request_store import RequestStore, to_state
from omni_runtime.orchestrator.shared import Shared
from omni_runtime.orchestrator.stage_client import RedisStageClient
from omni_runtime.redis_io.client_deadlines import DEADLINE_EXCEEDED
from omni_runtime.redis_io.clients import is_cluster
from omni_runtime.redis_io.joint_read import JointRead
from omni_runtime.redis_io.liveness import no_live_worker
from omni_runtime.redis_io.streams import BadEntry, GroupReader, ensure_group
from omni_runtime.watchdog import Progress
from omni_runtime.wire.outgoing import DurableRequestOut
from omni_runtime.wire.views import AbortView, ClientCommandView, RequestView

log = logging.getLogger(__name__)


class SlotService:
    def __init__(self, shared: Shared, slot: int, home: bool) -> None:
        s, p = shared.settings, shared.pipeline
        self.shared = shared
        self.slot = slot
        self.home = home
        """The process's own slot reads new requests; a slot taken over only its backlog."""
        self.names = names = s.names
        backoff = s.retry.backoff(bounded=True)
        consumer = keys.orchestrator_consumer(slot)
        # Every stage's outputs in one read (a cluster: in several slots, each read alone).
        joint = None
        if not is_cluster(shared.client):
            joint = JointRead(shared.client, keys.ORCHESTRATOR_GROUP, consumer, self._block_ms)
        self.stages = [
            RedisStageClient(
                shared.client,
                shared.writer,
                sid,
                names,
                read_count=s.read_count,
                block_ms=s.block_ms,
                max_message_bytes=s.max_message_bytes,
                streaming=p.mode == "streaming" and sid > 0,
                # data kept as read where nothing forwards it: streaming, or the last stage
                relay=p.mode == "streaming" or sid == p.last_stage,
                obs=shared.obs,
                backoff=backoff,
                slot=slot,
                fence=shared.leases,
                block_budget=self._block_ms,
                joint=joint,
            )
            for sid in range(p.last_stage + 1)
        ]
        hooks = Hooks(self._deliver, self._changed, shared.writer.send_now)
        self.core = build_orchestrator(p, self.stages, s.deadline_s, shared.obs.metrics, hooks)
        self.requests: GroupReader[RequestView | AbortView] = GroupReader(
            shared.client,
            names.requests,
            keys.ORCHESTRATOR_GROUP,
            keys.orchestrator_consumer(slot),
            cast("type[RequestView | AbortView]", ClientCommandView),
            max_bytes=s.max_message_bytes,
            dead_letters=names.dead_letters,
            metrics=shared.obs.metrics,
            backoff=backoff,
            block_budget=self._block_ms,
            on_bad=self._answer_malformed,
        )
        self.outbox = ClientOutbox(shared.writer, names, s.client_stream_ttl_s, s.max_message_bytes)
        self.client_of = self.outbox.client_of
        self.control = ControlGuard(
            shared, slot, home, self.client_of.__contains__, self.core.abort_request
        )
        """request id → client id, for the requests in flight."""
        self.store = RequestStore(
            shared.writer,
            names,
            slot,
            self._describe,
            enabled=s.durable_requests,
            failed=self._state_failed,
        )
        self.deadline_at: dict[str, float] = {}
        self.read_at: dict[str, float] = {}
        """request id → when it was read (loop time): was Redis short of memory since?"""
        self._entry_of: dict[str, tuple[bytes, RequestView]] = {}
        """request id → its requests-stream entry (and request), acknowledged once its state
        is registered."""
        self.backlog_done = False
        self.restored = 0
        """Requests in flight this slot's previous holder left, restored by `start`."""
        self._stopping = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._control_reader: asyncio.Task[None] | None = None
        self._in_hand = 0
        """Entries of the batch read that are not taken yet: the loop's work in hand."""
        self.taken = 0
        self.progress = Progress(
            f"orchestrator slot {slot}'s request loop",
            lambda: self._in_hand > 0,
            where=self._where,
        )
        """Watched by the process's watchdog: a batch in hand must be taken, entry by entry."""

    def _block_ms(self) -> int:
        """How long a read of this slot may block: `block_ms` with requests in flight; idle,
        `orchestrator_idle_block_ms` (an idle slot wakes seldom). Never past the lease fence."""
        s = self.shared.settings
        most = s.block_ms if self.client_of else s.orchestrator_idle_block_ms
        return min(most, self.shared.leases.read_block_ms())

    def groups(self) -> list[tuple[str, str]]:
        """The streams this slot reads, each with its group."""
        shared = [self.names.requests, *(st.out_stream for st in self.stages)]
        own = (self.names.control, self.control.group)
        return [*((stream, keys.ORCHESTRATOR_GROUP) for stream in shared), own]

    @property
    def idle(self) -> bool:
        """Nothing left to finish: a slot taken over may be given back."""
        done = self.backlog_done and self.control.backlog_done
        return done and not self.core.request_states and not self._entry_of

    async def start(self) -> int:
        """Restore the slot's durable states, then serve; the number of requests restored."""
        for stream, group in self.groups():
            await ensure_group(self.shared.client, stream, group)
        self.restored = restored = await self._restore()
        await self.core.start()
        self._reader = asyncio.create_task(self._read_requests(), name=f"requests-{self.slot}")
        self._control_reader = asyncio.create_task(self.control.run(), name=f"control-{self.slot}")
        return restored

    def stop_reading(self) -> None:
        """Read no more requests; the read in progress is cut short (what it was delivered
        stays pending: the slot's next holder reads it as backlog)."""
        self._stopping.set()
        self.requests.interrupt()
        self.control.interrupt()

    async def stop(self) -> None:
        """Stop reading requests, then the stages' readers and the core."""
        self.stop_reading()
        readers = [t for t in (self._reader, self._control_reader) if t is not None]
        if readers:
            s = self.shared.settings
            await asyncio.wait(readers, timeout=s.block_ms / 1000 + 5.0)
            await cancel_and_wait(readers)
        for stage in self.stages:
            await stage.quiesce()
        await self.core.shutdown()

    async def _restore(self) -> int:
        s = self.shared.settings
        if not s.durable_requests:
            return 0
        docs = await self.store.load(self.shared.client, s.max_message_bytes)
        now = time.time()
        for doc in docs:
            rid = doc.request_id
            left = None if doc.deadline_at is None else doc.deadline_at - now
            if not self.core.restore_request(rid, to_state(doc), left):
                continue
            self.outbox.restore(rid, doc.client_id, doc.out_seq)
            if doc.deadline_at is not None:
                self.deadline_at[rid] = doc.deadline_at
            for sid, seq in doc.stage_seq.items():
                if 0 <= sid < len(self.stages):
                    self.stages[sid].restore(rid, seq)
            self.shared.timer.started(rid)
        if docs:
            log.warning("slot %d: %d requests in flight restored", self.slot, len(docs))
        return len(docs)

    def _describe(self, rid: str, state: ReqState) -> DurableRequestOut | None:
        """The request's `DurableRequest`, as its writer's struct: built on every hop, so
        without the model's validation (it is validated when loaded)."""
        client_id = self.client_of.get(rid)
        if client_id is None:
            return None
        last = self.core.last_stage
        kept = (
            {
                sid: data
                for sid, data in state.stage_data.items()
                if sid < last and sid not in state.finished
            }
            if self.shared.pipeline.mode == "sequential"
            else {}
        )
        return DurableRequestOut(
            request_id=rid,
            client_id=client_id,
            prompt=state.prompt,
            params=state.params,
            deadline_at=self.deadline_at.get(rid),
            submitted=sorted(state.submitted),
            finished=sorted(state.finished),
            stage_data=kept,
            stage_seq={
                st.stage_id: st.handled_seq[rid] for st in self.stages if rid in st.handled_seq
            },
            out_seq=self.outbox.next_seq(rid),
        )

    def _changed(self, rid: str, state: ReqState | None) -> None:
        self.store.changed(rid, state)
        if state is None:
            self.deadline_at.pop(rid, None)
            self.read_at.pop(rid, None)
        queued = self._entry_of.pop(rid, None)
        if queued is not None:  # registered (or refused): the request entry is handled
            self._ack(queued[0])

    def _deliver(self, out: OrchOutput) -> None:
        queued = self._entry_of.pop(out.request_id, None)
        if queued is not None:  # ended before it was registered (refused, or failed)
            self._ack(queued[0])
        if out.finished:
            self.deadline_at.pop(out.request_id, None)
        if out.error == DEADLINE_EXCEEDED:  # say why, if Redis refused writes meanwhile
            why = self.shared.writer.memory.since(self.read_at.get(out.request_id, 0.0))
            if why is not None:
                out = OrchOutput(out.request_id, out.stage_id, None, True, f"{out.error}; {why}")
        self.outbox.send(out)
        if out.finished and (tracer := self.shared.obs.tracer) is not None:
            tracer.stamp(FINISHED, out.request_id)
        self.shared.timer.output(out.request_id, out.data, out.finished, out.error)

    def _where(self) -> str:
        """The request loop's stack (its thread is the event loop's, rarely where it is stuck)."""
        task = self._reader
        if task is None or task.done():
            ended = None if task is None or task.cancelled() else task.exception()
            return f"(the request loop has ended: {ended!r})"
        out = io.StringIO()
        out.write(f"{self._in_hand} entries in hand; ")
        task.print_stack(file=out)
        return out.getvalue()

    async def _read_requests(self) -> None:
        s, shared = self.shared.settings, self.shared
        while not self._stopping.is_set():
            self.progress.beat()
            if not await shared.leases.hold():
                return  # deposed: never read (and so take) another entry
            if self.home:
                batch = await self.requests.read(s.read_count, s.block_ms)
            else:  # a slot taken over reads its backlog, never new requests
                backlog = await read_backlog(self.requests, s.read_count)
                if backlog is None:
                    self.backlog_done = True
                    return
                batch = backlog
            self.backlog_done |= not self.requests.cursor.in_backlog
            if batch and shared.stage_watch.down and shared.recheck_stages is not None:
                with contextlib.suppress(RedisError):
                    await shared.recheck_stages()
            self._in_hand = len(batch)
            for entry_id, cmd in batch:
                if self.taken == self.shared.wedge_after:
                    log.warning("a test hook: slot %d's request loop blocks for good", self.slot)
                    await asyncio.Event().wait()
                try:
                    await self._take(entry_id, cmd)
                except Exception as e:  # this request fails alone; the slot serves on
                    self._take_failed(entry_id, cmd, e)
                self.taken += 1
                self._in_hand -= 1
                self.progress.beat()
            await asyncio.sleep(0)  # what was taken is submitted before the next read is sent

    async def _take(self, entry_id: bytes, cmd: RequestView | AbortView) -> None:
        core, shared = self.core, self.shared
        if isinstance(cmd, AbortView):
            if cmd.request_id in self.client_of:
                await core.abort_request(cmd.request_id, cmd.reason)
            else:  # another slot's (or ended): the one that holds it reads it there
                self.control.forward(cmd.request_id, cmd.reason)
            self._ack(entry_id)
            return
        rid = cmd.request_id
        if rid in self.client_of:
            queued = self._entry_of.get(rid)
            if queued is not None and queued[0] == entry_id:
                return  # read again (a backlog re-read): acknowledged once registered
            live = queued[1] if queued is not None else core.request_states.get(rid)
            if not intake.retransmitted(cmd, self.client_of[rid], live):
                self._refuse(cmd, intake.DUPLICATE_ID, intake.duplicate(rid))
            self._ack(entry_id)
            return
        refused = intake.refusal(cmd, shared.settings.max_deadline_s, self.core.final_stage_ids)
        if refused is None and shared.stage_watch.down:
            error = no_live_worker(min(shared.stage_watch.down))
            refused = (error, error)
        if refused is not None:
            self._refuse(cmd, *refused)
            self._ack(entry_id)
            return
        if cmd.trace:
            shared.obs.begin_trace(rid)  # traced on demand: this process stamps it too
        if (tracer := shared.obs.tracer) is not None:
            tracer.stamp("request_read", rid, None, self.requests.read_ns)
        self.client_of[rid] = cmd.client_id
        self.deadline_at[rid] = time.time() + (cmd.deadline_s or shared.settings.deadline_s)
        self.read_at[rid] = asyncio.get_running_loop().time()
        self._entry_of[rid] = (entry_id, cmd)
        shared.timer.started(rid)
        await core.add_request(rid, cmd.prompt, cmd.deadline_s, cmd.params)
        # acknowledged with the batch that writes its state
        if (reason := self.control.taken_abort(rid)) is not None:  # its abort came first
            await core.abort_request(rid, reason)

    def _refuse(self, cmd: RequestView, reason: str, error: str) -> None:
        """Answer a request that will not run with its one error final."""
        self.shared.obs.metrics.inc("omni_requests_refused_total", reason=reason)
        log.info("request refused: %s", error, extra={"request_id": cmd.request_id})
        self.outbox.refuse(cmd.request_id, cmd.client_id, error)

    def _ack(self, entry_id: bytes) -> None:
        self.shared.writer.xack(self.names.requests, keys.ORCHESTRATOR_GROUP, entry_id, True)

    def _take_failed(self, entry_id: bytes, cmd: RequestView | AbortView, e: Exception) -> None:
        """`_take` raised: a request it had not handed to the core gets one error final."""
        rid = cmd.request_id
        self.shared.obs.metrics.inc("omni_contained_errors_total", where="taking a request")
        log.error("taking a request failed: %r", e, exc_info=e, extra={"request_id": rid})
        queued = self._entry_of.get(rid)
        if isinstance(cmd, RequestView) and queued is not None and queued[0] == entry_id:
            if rid not in self.core.request_states:  # registered (or queued): the core ends it
                self._entry_of.pop(rid)
                self.client_of.pop(rid, None)
                self.deadline_at.pop(rid, None)
                self.outbox.refuse(rid, cmd.client_id, f"internal error: {type(e).__name__}: {e}")
        elif isinstance(cmd, RequestView) and rid not in self.client_of:
            self.outbox.refuse(rid, cmd.client_id, f"internal error: {type(e).__name__}: {e}")
        self._ack(entry_id)

    def _answer_malformed(self, bad: Sequence[BadEntry]) -> None:
        """Malformed requests are dead-lettered (by the reader); one that names a valid
        request id and client also gets one error final saying why."""
        for _entry_id, fields, error in bad:
            address = intake.answerable(fields, self.shared.settings.max_message_bytes)
            if address is not None:
                self.shared.obs.metrics.inc(
                    "omni_requests_refused_total", reason=intake.INVALID_REQUEST
                )
                self.outbox.refuse(*address, intake.invalid(error))

    def _state_failed(self, rid: str, e: Exception) -> None:
        """The request's durable state could not be written: it fails (one error final)."""
        self.shared.obs.metrics.inc("omni_contained_errors_total", where="saving a request state")
        log.error("request state not saved: %r", e, exc_info=e, extra={"request_id": rid})
        self.core.fail_soon(rid, f"request state cannot be saved: {type(e).__name__}: {e}")
