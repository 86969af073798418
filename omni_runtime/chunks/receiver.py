"""The RECV half of the ChunkAdapter (SPEC §4): one thread looping over a `RecvBook`.

The caller's side (`load_async`, `poll_ready`, `cleanup_receiver`, `discard`)
only touches the book under the lock, then `wake`s the transport. The RECV
thread reads a round (tokens and next ids) under the lock, fetches outside it,
and commits under it again only where the token is still the one read: that
makes `cleanup_receiver` a barrier against a fetch in flight. Between rounds
it blocks in `transport.wait_for_puts` itself.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from omni_runtime import keys
from omni_runtime.chunks.transport import ChunkTransport
from omni_runtime.core import foreign
from omni_runtime.core.chunk_book import Chunk
from omni_runtime.core.foreign import Raised
from omni_runtime.core.recv_book import Poll, RecvBook
from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io.backoff import Backoff

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1
"""Longest wait for puts while requests are registered, between checks of the sweeps."""
IDLE_SLEEP_S = 5.0
"""Longest sleep with nothing registered: registering, discarding and stopping notify."""
NO_PROGRESS_SLEEP_S = 0.001
"""Pause between polling rounds that found nothing, for transports with no wake-ups."""
SWEEP_INTERVAL_S = 0.5
"""With wake-ups: how often parked requests are polled anyway (a safety net, not the path)."""
READ_AHEAD = 8
"""Ids read per round for a request that just made progress (drains a backlog fast)."""
FLUSH_WAIT_S = 0.001
"""The one short wait when the last request went: lets a transport send what it held back."""
LATE_SWEEP_S = 1.0
"""A discarded request's unread chunks are deleted at once and again this much later,
for chunks its upstream put while the discard was under way."""
SWEEP_PAGE = 64
"""Keys deleted per sweep command; the next page only if this one was full."""


class ChunkReceiver:
    """Gets a stage's chunks from `src_stage_id`'s keys, on its own RECV thread."""

    def __init__(
        self,
        transport: ChunkTransport,
        src_stage_id: int,
        metrics: Metrics,
        on_ready: Callable[[], None] | None = None,
        *,
        stage_id: int,
    ) -> None:
        self.transport = transport
        self.src_stage_id = src_stage_id
        self.stage_id = stage_id
        """The receiving stage: counters carry it as their `stage` label."""
        self.metrics = metrics
        self.on_ready = on_ready
        """Called on the RECV thread after new chunks were committed: wakes a sleeping scheduler."""
        self._stop = threading.Event()
        self._lock = threading.RLock()
        """The book's lock (taken directly where nothing waits or is notified: a Condition's
        `with` is a Python call more)."""
        self._cv = threading.Condition(self._lock)
        self._book = RecvBook(READ_AHEAD, parks=transport.signals_puts)
        self._last_sweep = time.monotonic()
        self._sweeps: list[tuple[float, str, int]] = []
        """(due, request, first unread id): unread chunks of discarded requests to delete."""
        self.thread = threading.Thread(
            target=self._loop, name=f"chunk-recv-{stage_id}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    # --- caller's side: in-memory only ------------------------------------------

    def load_async(self, request_id: str) -> None:
        with self._cv:
            if not self._book.register(request_id):
                return
            self._cv.notify()
        self.transport.wake()

    def poll_ready(self) -> dict[str, list[Chunk]]:
        with self._lock:
            return self._book.take_ready()

    def cleanup_receiver(self, request_id: str) -> None:
        with self._lock:
            self._book.cleanup(request_id)

    def discard(self, request_id: str) -> None:
        now = time.monotonic()
        with self._cv:
            first = self._book.next_id(request_id)
            self._sweeps += [(now, request_id, first), (now + LATE_SWEEP_S, request_id, first)]
            self._book.cleanup(request_id)
            self._cv.notify()
        self.transport.wake()

    def pending_receives(self) -> int:
        with self._lock:
            return self._book.registered()

    def request_stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        self.transport.wake()

    # --- RECV thread -------------------------------------------------------------

    def _loop(self) -> None:
        backoff = Backoff(initial_s=0.01, max_s=1.0)
        idle_before = True
        while not self._stop.is_set():
            wait_s = self._idle_wait_s()
            if wait_s is None:  # nothing registered, nothing to sweep: puts cannot matter
                if not idle_before:
                    idle_before = True
                    self._step(functools.partial(self._wait, FLUSH_WAIT_S), backoff)
                with self._cv:
                    if self._idle_wait_s() is None and not self._stop.is_set():
                        self._cv.wait(IDLE_SLEEP_S)
                continue
            idle_before = False
            if wait_s > 0:
                self._step(functools.partial(self._wait, wait_s), backoff)
            else:
                self._step(self._round, backoff)

    def _idle_wait_s(self) -> float | None:
        """0: work to do now; else how long to wait for puts; None: nothing registered."""
        now = time.monotonic()
        with self._lock:
            next_sweep = min((at for at, _r, _f in self._sweeps), default=None)
            if self._book.busy() or (next_sweep is not None and next_sweep <= now):
                return 0.0
            if not self._book.registered() and next_sweep is None:
                return None
            if self._book.has_parked() and now - self._last_sweep >= SWEEP_INTERVAL_S:
                self._last_sweep = now
                self._book.unpark_all()
                return 0.0
            due = [self._last_sweep + SWEEP_INTERVAL_S, now + IDLE_WAIT_S]
            if next_sweep is not None:
                due.append(next_sweep)
            return max(0.001, min(due) - now)

    def _step(self, step: Callable[[], None], backoff: Backoff) -> None:
        try:
            step()
            backoff.succeeded()
        except Exception as e:  # the RECV thread must outlive any failure of a round (which
            # runs a connector's code, and may raise anything): counted, retried
            self.metrics.inc("omni_chunk_get_failures_total", stage=self.stage_id)
            delay_s = backoff.failed() or 1.0
            log.warning("chunk read failed (retrying in %.2fs): %r", delay_s, e)
            self._stop.wait(delay_s)

    def _wait(self, timeout_s: float) -> None:
        """Wait for puts; a wake-up that queued a request is read in the same step (the
        chunk it announced is on the path to a waiting scheduler)."""
        if self._woken(self.transport.wait_for_puts(timeout_s)):
            self._round()

    def _woken(self, reported: dict[str, int]) -> bool:
        """Record reported puts; whether there is a round to run now."""
        rids = {}
        for route, upto in reported.items():
            rid, stage = keys.split_route_id(route)
            if stage == self.src_stage_id:
                rids[rid] = upto
        if not rids:
            return False
        with self._lock:
            self._book.woken(rids)
            return self._book.busy()

    def _round(self) -> None:
        """Due sweeps, subscriptions, then one fetch + commit of every queued request."""
        sweeps: list[tuple[str, int]] = []
        with self._lock:
            routes = self._book.take_routes()
            if self._sweeps:
                now = time.monotonic()
                sweeps = [(rid, first) for at, rid, first in self._sweeps if at <= now]
                self._sweeps = [sw for sw in self._sweeps if sw[0] > now]
            batch = self._book.take_round()
        for rid, first in sweeps:  # first: each sweep handles its own failure
            self._sweep(rid, first)
        if routes:
            self._route(routes, batch)
        if batch:
            self._fetch(batch)

    def _route(self, routes: dict[str, bool], batch: list[Poll]) -> None:
        src = self.src_stage_id
        done = False
        try:
            self.transport.unsubscribe(
                [keys.route_id(r, src) for r, on in routes.items() if not on]
            )
            self.transport.subscribe([keys.route_id(r, src) for r, on in routes.items() if on])
            done = True
        finally:
            if not done:  # whatever stopped it (then raised on): the routes are retried
                with self._lock:
                    self._book.retry_routes(routes)
                    self._book.requeue(batch)

    def _fetch(self, batch: list[Poll]) -> None:
        src = self.src_stage_id
        round_keys = [
            keys.chunk_key(p.request_id, src, p.next_id + j) for p in batch for j in range(p.depth)
        ]
        fetched = False
        try:
            values = self.transport.fetch(round_keys)
            fetched = True
        finally:
            if not fetched:  # whatever stopped it (then raised on): the round is retried
                with self._lock:
                    self._book.requeue(batch)
        with self._lock:
            done = self._book.commit(batch, values)  # a MalformedChunk is not a chunk: skipped
        for rid, chunk_id in done.malformed:
            self.metrics.inc("omni_malformed_chunks_total", stage=self.stage_id)
            log.error(
                "malformed chunk %s skipped",
                keys.chunk_key(rid, src, chunk_id),
                extra={"request_id": rid},
            )
        if not done.received:
            if not self.transport.signals_puts:
                self.transport.wait_for_puts(NO_PROGRESS_SLEEP_S)
            return
        if self.on_ready is not None:  # first: the scheduler's wake overlaps the counting
            self.on_ready()
        self.metrics.inc("omni_chunks_received_total", done.received, stage=self.stage_id)

    def _sweep(self, request_id: str, first: int) -> None:
        """Delete a discarded request's unread chunks, page by page while pages are full."""
        while True:
            page = [
                keys.chunk_key(request_id, self.src_stage_id, first + i) for i in range(SWEEP_PAGE)
            ]
            discarded = foreign.call(self.transport.discard, page)  # a connector's code
            if isinstance(discarded, Raised):  # best effort: unread chunks expire anyway
                log.warning(
                    "deleting unread chunks of discarded %r failed (they expire): %r",
                    request_id,
                    discarded.error,
                    extra={"request_id": request_id},
                )
                return
            if discarded < len(page):
                return
            first += len(page)
