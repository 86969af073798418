"""The worker's reading threads: they block on Redis so the scheduler loop never has to.

Each takes narrow callables (where to hand what it read), never the worker. Input
entries are parsed and validated here, so the loop only sees valid `Input`s. A
process stops its threads together: `request_stop()` on all, then `join()` on all.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import redis
from redis.exceptions import RedisError

from omni_runtime import keys
from omni_runtime.errors import CodecError
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.start import Observability
from omni_runtime.redis_io.backoff import RetrySettings
from omni_runtime.redis_io.interrupt import OwnConnection
from omni_runtime.redis_io.refusals import is_oom
from omni_runtime.redis_io.streams import Entry, SyncGroupReader, parse_entry, stream_reply
from omni_runtime.watchdog import Progress, redis_retries_s
from omni_runtime.wire.messages import AbortMsg
from omni_runtime.wire.views import StageInputView
from omni_runtime.worker.actions import Input
from omni_runtime.worker.redelivery import Redelivery

log = logging.getLogger(__name__)

IDLE_READ_BLOCK_MS = 250
"""A blocking read returns the moment an entry arrives; its timeout only sets how often an
idle worker wakes (CPU) and how long a stopping thread may take to notice."""
SLOT_WAIT_S = 0.1
"""With no free slot, the input thread re-checks its stop flag this often."""
UNBLOCK_EVERY_S = 0.05
"""While joining a reading thread, its read is ended again this often (until it is out)."""

T = TypeVar("T")


class Handoff(Generic[T]):
    """Items an I/O thread delivers to the loop; each delivery calls `wake` (which wakes the
    loop, or runs its pass: `LoopTurn.deliver`)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._items: list[T] = []
        self._wake = wake

    def put(self, items: list[T]) -> None:
        with self._lock:
            self._items.extend(items)
        self._wake()

    def take(self) -> list[T]:
        with self._lock:
            items, self._items = self._items, []
        return items

    @property
    def waiting(self) -> bool:
        """Items were delivered that the loop has not taken (a read, without the lock)."""
        return bool(self._items)


class Slots:
    """The worker's free request slots, shared by the input thread and the scheduler.

    The reader takes slots before it reads and the scheduler gives them back as requests
    leave, under one lock: inputs in flight between the two are always counted, so a
    worker never reads past its concurrency (the rest stays for other replicas).
    """

    def __init__(self, capacity: int) -> None:
        self._free = capacity
        self._paused = False
        self._cv = threading.Condition()

    def take_up_to(self, n: int, timeout_s: float) -> int:
        """Take up to `n` free slots, waiting up to `timeout_s` for one; 0 if none freed
        (or while paused)."""
        with self._cv:
            self._cv.wait_for(lambda: self._free > 0 and not self._paused, timeout_s)
            taken = 0 if self._paused else max(0, min(n, self._free))
            self._free -= taken
            return taken

    def pause(self) -> None:
        """No slot is taken until `resume`: suspects run alone (`isolation.py`)."""
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def force_take(self, n: int) -> None:
        """Inputs taken over from a dead replica run even beyond the concurrency."""
        with self._cv:
            self._free -= n

    def give_back(self, n: int) -> None:
        if n:
            with self._cv:
                self._free += n
                self._cv.notify_all()

    @property
    def free(self) -> int:
        with self._cv:
            return self._free


@dataclass(frozen=True, slots=True)
class ReaderSettings:
    """What a reading thread takes of the settings (`Settings.part`)."""

    read_count: int
    block_ms: int
    max_message_bytes: int
    retry: RetrySettings


def retries_s(retry: RetrySettings) -> float:
    """The longest a bounded Redis retry keeps a reading thread from going around."""
    return redis_retries_s(retry.retry_attempts, retry.retry_max_s)


class _Loop:
    """A daemon thread running `_run` until `request_stop()`; a reading one blocks on its
    own connection (`own`), whose read `request_stop` and `join` end. Each round of `_run`
    beats `progress` (the process's watchdog watches it until the thread is stopped)."""

    def __init__(
        self, name: str, stop: threading.Event | None = None, slack_s: float = 0.0
    ) -> None:
        self._stop = stop or threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.own: OwnConnection | None = None
        self.progress = Progress(
            f"the worker's {name} thread", lambda: not self._stop.is_set(), slack_s=slack_s
        )
        """`slack_s`: its longest legitimate wait (a Redis retry, a heartbeat's sleep)."""

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        self._stop.set()
        if self.own is not None:
            self.own.unblock()

    def join(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < end:
            if self.own is not None:  # again: a read may have begun just after the last
                self.own.unblock()
            self._thread.join(min(UNBLOCK_EVERY_S, max(0.0, end - time.monotonic())))
        if self.own is not None and not self._thread.is_alive():
            self.own.close()

    def _run(self) -> None:
        raise NotImplementedError


class InputThread(_Loop):
    """XREADGROUP on the stage's input stream, as many entries as there are free slots.

    Malformed entries are dead-lettered by the reader (the kit's one path); valid ones
    are handed over as `Input`s, stamped `input_read` with the time the read returned.
    """

    def __init__(
        self,
        reader: SyncGroupReader[StageInputView],
        slots: Slots,
        deliver: Callable[[list[Input]], None],
        settings: ReaderSettings,
        *,
        stage_id: int,
        obs: Observability,
        stop: threading.Event | None = None,
        redelivery: Redelivery | None = None,
    ) -> None:
        super().__init__("input-reader", stop, retries_s(settings.retry))
        self.redelivery = redelivery
        """Counts what the backlog walk reads again (a previous life's inputs)."""
        self.reader = reader
        self.slots = slots
        self.deliver = deliver
        self.read_count = settings.read_count
        self.block_ms = max(settings.block_ms, IDLE_READ_BLOCK_MS)
        self.stage_id = stage_id
        self.obs = obs
        """Its tracers, read at each stamp (started with the worker's `run`)."""

    def start(self) -> None:
        self.own = OwnConnection(self.reader.client, "input-reader")
        self.reader.client = self.own.client  # this thread alone reads and acks with it
        super().start()

    def request_stop(self) -> None:
        super().request_stop()
        self.slots.give_back(0)

    def _run(self) -> None:
        block_ms = self.own.block_ms(self.block_ms) if self.own is not None else self.block_ms
        while not self._stop.is_set():
            self.progress.beat()
            n = self.slots.take_up_to(self.read_count, SLOT_WAIT_S)
            if n == 0:
                continue
            got: list[tuple[bytes, StageInputView]] = []
            walking = self.reader.cursor.in_backlog
            try:
                got = self.reader.read(n, block_ms)
            finally:
                self.slots.give_back(n - len(got))
            if not got:
                continue
            for _eid, msg in got:  # the process's tracer, or a request's own (`trace`)
                tracer = self.obs.tracer or (self.obs.on_demand if msg.trace else None)
                if tracer is not None:
                    tracer.stamp("input_read", msg.request_id, self.stage_id, self.reader.read_ns)
            if walking and self.redelivery is not None:  # a previous life's, perhaps its death
                self.deliver(self.redelivery.backlog(got))
            else:
                self.deliver([Input(eid, msg) for eid, msg in got])


class ControlThread(_Loop):
    """Follows the broadcast control stream (aborts). It starts with the aborts the stream
    still holds (`keys.CONTROL_STREAM_AGE_S` before its last one): a request aborted while
    this stage's worker was down must not be run by the one started in its place, which
    takes over that worker's inputs (a suspect one alone, holding up the rest)."""

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        deliver: Callable[[list[str]], None],
        settings: ReaderSettings,
        metrics: Metrics,
    ) -> None:
        super().__init__("control-reader", None, retries_s(settings.retry))
        self.client = client
        self.stream = stream
        self.deliver = deliver
        self.read_count = settings.read_count
        self.block_ms = max(settings.block_ms, IDLE_READ_BLOCK_MS)
        self.max_bytes = settings.max_message_bytes
        self.backoff = settings.retry.backoff()
        self.metrics = metrics
        self._last_id = b"0-0"

    def start(self) -> None:
        """Delivers the stream's recent aborts before its thread starts (and so before the
        takeover and the input thread, which the worker starts next, deliver anything they
        abort)."""
        # Entries of bytes: our clients never use decode_responses (redis-py's stub allows str).
        last = cast("list[Entry]", self.client.xrevrange(self.stream, count=1))
        if last:
            self._last_id = last[0][0]
            newest_ms = int(self._last_id.split(b"-")[0])
            since = f"{max(0, newest_ms - int(keys.CONTROL_STREAM_AGE_S * 1000))}-0"
            recent: list[str] = []
            while True:
                page = cast(
                    "list[Entry]",
                    self.client.xrange(self.stream, since, self._last_id, count=self.read_count),
                )
                recent += self._aborts_in(page)
                if len(page) < self.read_count or page[-1][0] == self._last_id:
                    break
                since = "(" + page[-1][0].decode()
            if recent:
                log.info(
                    "%d recent aborts on %s before this worker started", len(recent), self.stream
                )
                self.deliver(recent)
        self.own = OwnConnection(self.client, "control-reader")
        super().start()

    def _aborts_in(self, entries: list[Entry]) -> list[str]:
        aborts: list[str] = []
        for entry_id, fields in entries:
            try:
                aborts.append(parse_entry(fields, AbortMsg, self.max_bytes).request_id)
            except CodecError as e:  # untrusted: `parse_entry` refuses it as one
                # Broadcast: every worker sees it; the orchestrators' group on this
                # stream dead-letters it (`orchestrator/control.py`).
                self.metrics.inc("omni_malformed_entries_total", stream=self.stream)
                log.warning("malformed control entry %s skipped: %s", entry_id, e)
        return aborts

    def _run(self) -> None:
        own = self.own or OwnConnection(self.client, "control-reader")
        block_ms = own.block_ms(self.block_ms)
        while not self._stop.is_set():
            self.progress.beat()
            try:
                reply = own.client.xread(
                    {self.stream: self._last_id}, count=self.read_count, block=block_ms
                )
                self.backoff.succeeded()
            except RedisError as e:
                delay = self.backoff.failed() or 0.0
                log.warning("reading %s failed, retrying in %.2fs: %r", self.stream, delay, e)
                self._stop.wait(delay)
                continue
            aborts: list[str] = []
            for _s, entries in stream_reply(reply):
                if entries:
                    self._last_id = entries[-1][0]
                aborts += self._aborts_in(entries)
            if aborts:
                self.deliver(aborts)


class HeartbeatThread(_Loop):
    """Keeps the worker's heartbeat key alive; its value is the worker's status document.

    The value is JSON (`worker_id`, `stage_id`, `host`, `pid`, `started_at`, `in_flight`,
    `completed`, ...), so tests and tools can read a worker's counters from Redis. After
    each beat it runs `after_beat` (taking over the inputs of dead replicas).
    """

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        interval_s: float,
        ttl_ms: int,
        status: Callable[[], dict[str, Any]],
        after_beat: Callable[[], None],
        fence_check: Callable[[float], None] = lambda _started: None,
        retries_s: float = 0.0,
    ) -> None:
        super().__init__("heartbeat", None, retries_s + interval_s)
        self.client = client
        self.key = key
        self.interval_s = interval_s
        self.ttl_ms = ttl_ms
        self.status = status
        self.after_beat = after_beat
        self.fence_check = fence_check
        """Given when the beat started: the key's TTL counts from about then."""

    def start(self) -> None:
        started = time.monotonic()
        self.beat()  # visible before the first read, so nobody takes us for dead
        self.fence_check(started)
        super().start()

    def beat(self) -> None:
        """SET the document; Redis out of memory refuses the SET, not the PEXPIRE after
        it, so the key lives on (its document a beat old) and the worker is not taken for
        dead while Redis is full."""
        doc = json.dumps(self.status(), separators=(",", ":"))
        with self.client.pipeline(transaction=False) as pipe:
            pipe.set(self.key, doc, px=self.ttl_ms)
            pipe.pexpire(self.key, self.ttl_ms)
            beat, kept = pipe.execute(raise_on_error=False)
        for reply in (beat, kept):
            if isinstance(reply, RedisError) and not is_oom(reply):
                raise reply

    def forget(self) -> None:
        """Delete the key at shutdown: a stopped worker is gone at once, not after the TTL."""
        with contextlib.suppress(RedisError):
            self.client.delete(self.key)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.progress.beat()
            try:
                started = time.monotonic()
                self.beat()
                self.fence_check(started)
                self.after_beat()
            except RedisError as e:
                log.warning("heartbeat failed: %r", e)
