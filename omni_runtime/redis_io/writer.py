"""The batching writer of the control plane: every XADD / XACK / EXPIRE of an asyncio process.

Whatever accumulated while the previous round trip was in flight goes out as one pipeline
(one round trip per message would cap a process at a few thousand messages per second on
loopback), but never two entries of one request on one stream (`write_ops.first_wave`).
With nothing in flight, a caller whose step queued writes may send the batch at once
(`send_now`); the writer task then only reads its replies.

Redis answers each command on its own, and runs the rest of a pipeline around one it
refuses, so only the writes whose command failed are written again (an XADD sent twice
would be two entries): refused for now, at once, within the bounded `Backoff`; for
memory (`maxmemory` with `noeviction`), held and written again later, in order, while
the batches after them (acknowledgements and deletions, which free memory) go on
(`held_writes`); for good (an expiry out of range), never. A round trip that fails
whole (a dropped connection, a timeout) is written again whole: which of its commands
ran is unknown, and a consumer drops a repeated entry by its `seq`. What is given up is
counted, reported (`written()` → False) and, for writes that belong to a request, told
to `on_failed`, so that request ends with an error instead of waiting.

An orchestrator adds two things: `sources` give, as a batch is taken, the durable
request states changed since the last one (written after the entries they follow and
before the acknowledgements that depend on them), and a `fence` holds every batch
while the process's lease is not known fresh, and refuses it once the lease is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from omni_runtime.errors import RedisOutOfMemoryError, TransportError
from omni_runtime.observe.start import Observability
from omni_runtime.redis_io import write_ops
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.clients import REDIS_FAILURES, is_cluster
from omni_runtime.redis_io.conn import one_timeout, take_async
from omni_runtime.redis_io.held_writes import HeldWrites
from omni_runtime.redis_io.packed_async import AsyncPackedPipe, cluster_round_trips
from omni_runtime.redis_io.refusals import MemorySeen, Replies, sort_replies
from omni_runtime.redis_io.write_ops import Expire, Op, XAck, XAdd, XDel, fill_pipeline, owners

if TYPE_CHECKING:
    from omni_runtime.redis_io.liveness import Fence

log = logging.getLogger(__name__)

DEFAULT_ATTEMPTS = 20
"""Writes always give up at last: a scheduler must never retry forever."""
WRITE_TIMEOUT_S = 5.0
"""A batch's replies all within this (redis-py's read timeout, per pipeline): else it failed."""


@dataclass
class _Batch:
    """What one round trip carries, and who waits for it."""

    ops: list[Op]
    done: list[asyncio.Future[bool]]
    traced: list[tuple[str, int]]
    pipe: AsyncPackedPipe | None = None
    """Set once sent ahead by `send_now` (its replies still to read)."""
    carried: list[list[Op]] | None = None  # per command sent ahead, the ops it carries


FailedHook = Callable[[list[str], TransportError], None]
"""Told the requests whose writes were given up, and why (what Redis said, or out of memory)."""


class StreamWriter:
    """Batches XADD / XACK / EXPIRE of one asyncio process into one pipeline per round trip."""

    def __init__(
        self,
        client: aioredis.Redis,
        maxlen: int,
        *,
        obs: Observability | None = None,
        backoff: Backoff | None = None,
        hold_refused: bool = True,
        fence: Fence | None = None,
        on_failed: FailedHook | None = None,
    ) -> None:
        self.client = client
        self.maxlen = maxlen
        self.obs = obs or Observability()
        """Its counters, and the tracer of the moment for the stage inputs' writes."""
        self.metrics = self.obs.metrics
        self.backoff = b = backoff or Backoff(0.01, 1.0, DEFAULT_ATTEMPTS)
        """Bounded: after `max_attempts` failures a batch is dropped and reported."""
        self.hold_refused = hold_refused
        """Writes refused for memory are held and written again later (an orchestrator: its
        requests go on once memory is freed); else given up at once (a client: a refused
        submission is answered at once, and never written behind its caller's back)."""
        self.on_failed = on_failed
        self.memory = MemorySeen()
        bounded = Backoff(b.initial_s, b.max_s, b.max_attempts or DEFAULT_ATTEMPTS)
        self._held = HeldWrites(b.initial_s, bounded.budget_s())
        self.sources: list[Callable[[], list[Op]]] = []
        """Called as each batch is taken: the ops that record state changed since."""
        self.fence = fence
        self._cluster = is_cluster(client)
        self._traced: list[tuple[str, int]] = []
        """(request id, stage id) of the stage inputs queued since the last batch (tracing on)."""
        self._ops: list[Op] = []
        self._done: list[asyncio.Future[bool]] = []
        """Resolved when the batch holding what was queued before them was written."""
        self._conn: Any = None
        """The connection batches go out on (single server), held once the first batch made it."""
        self._sent: _Batch | None = None
        self._busy = False
        """A batch is on its way (taken and not settled): no other may be taken meanwhile."""
        self._pending = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._gone = False  # `run` has ended: a write queued now is dropped at once
        self._in_flight: _Batch | None = None

    @property
    def dropped_writes(self) -> int:
        """Writes given up on so far (`omni_dropped_writes_total`)."""
        return int(self.metrics.value("omni_dropped_writes_total", source="writer"))

    def xadd(
        self,
        stream: str,
        fields: dict[str, Any],
        maxlen: int | None = None,
        urgent: bool = False,
        trace: tuple[str, int] | None = None,
        max_age_s: float | None = None,
        merge_up_to: int = 0,
        owner: str | None = None,
    ) -> None:
        """`urgent` entries (a stage's next input) go last in their pipeline, so that their
        reader is answered first (`fill_pipeline`), before the clients given outputs. `trace`
        (request id, stage id) stamps when the pipeline carrying the entry starts and ends.
        `owner`: the request the entry belongs to (`on_failed` hears if it is given up)."""
        if trace is not None and self.obs.tracer is not None:
            self._traced.append(trace)
        maxlen = maxlen or self.maxlen
        self.queue(XAdd(stream, fields, maxlen, urgent, max_age_s, merge_up_to, owner))

    def xack(self, stream: str, group: str, entry_id: bytes, delete: bool = False) -> None:
        """`delete`: also XDEL it (a stream read by one group only)."""
        self.queue(XAck(stream, group, entry_id, delete))

    def expire(self, key: str, ttl_s: int) -> None:
        self.queue(Expire(key, ttl_s))

    def wake(self) -> None:
        """A source has something for the next batch."""
        self._idle.clear()
        self._pending.set()

    def queue(self, op: Op) -> None:
        """Any write op for the next batch (`write_ops`); the methods above build the usual."""
        if self._gone:
            self._dropped([op])
            return
        self._ops.append(op)
        self._idle.clear()
        self._pending.set()

    @property
    def out_of_memory(self) -> str | None:
        """What Redis said, while it refuses this writer's writes for memory."""
        return self.memory.now

    @property
    def stopped(self) -> bool:
        """`run` has ended: nothing queued will be written any more."""
        return self._gone

    async def flushed(self) -> None:
        """Wait until everything queued so far reached Redis (or was given up on)."""
        await self._idle.wait()

    async def written(self) -> bool:
        """Wait for the batch holding everything queued so far; False unless all of it was
        written (some was given up on, or held for memory). Unlike `flushed`, later writes
        do not make the caller wait longer."""
        if self._gone:  # nothing queued will be written any more
            return False
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._done.append(done)
        self._pending.set()
        return await done

    async def run(self) -> None:
        """Until cancelled. Then, as when asyncio.run cancels every task on Ctrl-C, what is
        queued will never be written: dropped and counted; waiters are told False (what
        was in flight may have been written, or not)."""
        try:
            await self._run()
        finally:
            self._gone = True
            unsent, self._ops = [*self._held.drain(), *self._ops], []
            if unsent:
                log.warning("stream writer stopped with %d writes unsent", len(unsent))
                self._dropped(unsent)
            for fut in [*(self._in_flight.done if self._in_flight else []), *self._done]:
                if not fut.done():
                    fut.set_result(False)
            self._idle.set()

    async def _run(self) -> None:
        while True:
            due_at = self._held.due_at
            with contextlib.suppress(TimeoutError):  # held writes: written again when due
                async with asyncio.timeout_at(due_at):
                    await self._pending.wait()
            self._pending.clear()
            batch, self._sent = self._sent, None
            self._busy = True
            try:
                await (self._take_and_write() if batch is None else self._settle(batch))
            finally:
                self._busy = False
            if self._ops or self._done:  # queued meanwhile (a batch sent ahead took none)
                self._pending.set()
            elif not self._held:
                self._idle.set()

    def send_now(self) -> None:
        """With writes queued and no batch on its way, send the batch now, from the
        caller's step (one whose state changes are complete: the durable states go with
        it): waiting for the writer task's turn, behind the readers' next reads, held a
        light-load hop back (docs/architecture.md gives the figures). The writer task
        reads the replies."""
        conn = self._conn
        if not self._ops or self._busy or conn is None or not conn.is_connected:
            return
        if self.fence is not None and not self.fence.fresh():
            return  # the writer task waits for the fence, as for any batch
        batch = self._take()
        pipe = AsyncPackedPipe(self.client)
        batch.carried = fill_pipeline(pipe, batch.ops)
        self._stamp("input_write_start", batch.traced)
        try:
            pipe.send(conn)
            batch.pipe = pipe
        except (RedisError, OSError, RuntimeError) as e:  # not connected, or its transport
            # closed for writing (asyncio's RuntimeError): the writer task writes it as usual
            log.warning("stream write could not be sent at once: %r", e)
        self._sent, self._busy = batch, True
        self._pending.set()

    def _take(self) -> _Batch:
        """The next round trip's ops; those for the one after (`first_wave`) wait in front."""
        ops, self._ops = self._ops, []
        for src in self.sources:
            ops.extend(src())
        ops, later = write_ops.first_wave(self._held.take(ops, asyncio.get_running_loop().time()))
        self._ops[:0] = later
        done, self._done = ([], self._done) if later else (self._done, [])
        traced, self._traced = self._traced, []
        self._in_flight = batch = _Batch(ops, done, traced)
        return batch

    async def _take_and_write(self) -> bool:
        refused = self.fence is not None and not await self.fence.hold()
        batch = self._take()
        if refused:  # deposed: what it queued is refused, never written
            self._dropped(batch.ops)
            batch.ops = []
        self._stamp("input_write_start", batch.traced)
        return self._settled(batch, not refused and await self._guarded(batch.ops))

    async def _settle(self, batch: _Batch) -> bool:
        """The replies of a batch `send_now` sent; if they fail, written again the usual way
        (bounded retries), once the fence holds again."""
        if batch.pipe is not None and batch.carried is not None:
            try:
                async with one_timeout(WRITE_TIMEOUT_S):
                    replies = await batch.pipe.replies(self._conn, raise_on_error=False)
            except (RedisError, TimeoutError, OSError) as e:
                log.warning("stream write failed, retrying: %r", e)
                self.metrics.inc("omni_retries_total", source="writer")
            else:
                sorted_ = sort_replies(replies, batch.carried)
                ok = self._sorted(sorted_)
                if sorted_.again:  # refused for now: those alone, the usual way
                    ok = await self._guarded(sorted_.again) and ok
                return self._settled(batch, ok)
            if self.fence is not None and not await self.fence.hold():
                self._dropped(batch.ops)  # deposed meanwhile (a stall): never written late
                return self._settled(batch, False)
        return self._settled(batch, await self._guarded(batch.ops))

    async def _guarded(self, ops: list[Op]) -> bool:
        try:
            return await self._write(ops) if ops else True
        except REDIS_FAILURES as e:  # what `_write` does not retry: given up, the writer goes on
            log.exception("stream writer failed on a batch of %d writes", len(ops))
            self._give_up(ops, TransportError(f"stream writer failed: {e!r}"))
            return False

    def _settled(self, batch: _Batch, ok: bool) -> bool:
        self._stamp("input_written", batch.traced)
        for fut in batch.done:
            if not fut.done():
                fut.set_result(ok)
        return ok

    def _stamp(self, event: str, traced: list[tuple[str, int]]) -> None:
        tracer = self.obs.tracer
        if tracer is not None:
            for rid, sid in traced:
                tracer.stamp(event, rid, sid)

    def _dropped(self, ops: list[Op]) -> None:
        for op in ops:
            where = op.stream if isinstance(op, XAdd | XAck | XDel) else op.key
            self.metrics.inc("omni_dropped_writes_total", stream=where, source="writer")

    def _give_up(self, ops: list[Op], error: TransportError) -> None:
        """Dropped and counted; the requests they belong to are told (`on_failed`)."""
        if not ops:
            return
        self._dropped(ops)
        rids = list(dict.fromkeys(rid for op in ops for rid in owners(op)))
        if rids and self.on_failed is not None:
            self.on_failed(rids, error)

    def _sorted(self, replies: Replies) -> bool:
        """Settle what one round trip's replies decided (all but `again`); whether every op
        was written."""
        now = asyncio.get_running_loop().time()
        self._held.forget(replies.written)
        if replies.needed_memory:
            if self.memory.now is not None:
                log.warning("Redis takes writes again (%d held)", len(self._held))
                self.memory.now = None
            self._held.room(now)
        for ops, e in replies.out_of_memory:
            self.metrics.inc("omni_redis_oom_refusals_total", source="writer")
            first = self.memory.now is None
            message = self.memory.refused(e, now)
            if first:
                log.error("%s: %d writes refused", message, len(ops))
            over = self._held.hold(ops, now) if self.hold_refused else ops
            self._give_up(over, RedisOutOfMemoryError(message))
        for ops, e in replies.failed:
            log.error("Redis refused %d writes for good: %r", len(ops), e)
            self._held.forget(ops)
            self._give_up(ops, TransportError(f"Redis refused a write: {e}"))
        return not (replies.out_of_memory or replies.failed)

    async def _execute(self, ops: list[Op]) -> tuple[list[Any], list[list[Op]]]:
        """One round trip packed by hand on the held connection of a single server (on a
        cluster, `cluster_round_trips`). Each command's reply or error, and its ops."""
        if self._cluster:
            return await cluster_round_trips(self.client, ops)
        if self._conn is None:  # held for good: the pool still closes it with the client
            self._conn = await take_async(self.client.connection_pool)
        packed = AsyncPackedPipe(self.client)
        carried = fill_pipeline(packed, ops)
        return await packed.execute(self._conn, raise_on_error=False), carried

    async def _write(self, ops: list[Op]) -> bool:
        """Write `ops`; what is refused for now, again (alone) until the retries run out."""
        b = self.backoff
        policy = Backoff(b.initial_s, b.max_s, b.max_attempts or DEFAULT_ATTEMPTS)
        ok = True
        while True:
            error: BaseException
            try:
                async with one_timeout(WRITE_TIMEOUT_S):
                    replies, carried = await self._execute(ops)
            except (RedisError, TimeoutError) as e:  # which commands ran is unknown: all again
                error = e
            else:
                sorted_ = sort_replies(replies, carried)
                ok = self._sorted(sorted_) and ok
                if not sorted_.again:
                    return ok
                ops = sorted_.again
                error = next(r for r in replies if isinstance(r, RedisError))
            delay = policy.failed()
            if delay is None:
                log.error("giving up on %d stream writes: %r", len(ops), error)
                self._held.forget(ops)
                self._give_up(ops, TransportError(f"Redis write failed: {error!r}"))
                return False
            self.metrics.inc("omni_retries_total", source="writer")
            log.warning("stream write failed (attempt %d), retrying: %r", policy.failures, error)
            await asyncio.sleep(delay)
            if self.fence is not None and not await self.fence.hold():
                self._dropped(ops)  # the lease was lost meanwhile: never write it late
                return False
