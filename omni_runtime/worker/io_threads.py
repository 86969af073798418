"""The worker's I/O threads: they block on Redis so the scheduler loop never has to."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import redis
from redis.exceptions import RedisError, ResponseError
from redis.typing import StreamIdT

from omni_runtime import codec, keys
from omni_runtime.errors import CodecError
from omni_runtime.messages import AbortMsg
from omni_runtime.redis_io.streams import Entry, ensure_group_sync, parse_entry, stream_reply

if TYPE_CHECKING:
    from omni_runtime.worker.proc import StageWorker

log = logging.getLogger(__name__)

IDLE_READ_BLOCK_MS = 1000
"""A blocking read returns the moment an entry arrives; its timeout only sets how often an
idle worker wakes (CPU) and how long `stop()` may wait for the thread."""


class InputReader:
    """Blocking XREADGROUP on the stage's input stream, bounded by the worker's free slots.

    Entries beyond the worker's concurrency stay in the stream, where another
    replica of the stage can take them.
    """

    def __init__(self, worker: StageWorker, client: redis.Redis) -> None:
        self.worker = worker
        self.client = client
        self._cv = threading.Condition()
        self._inbox: list[Entry] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="input-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.slots_freed()
        self._thread.join(5)

    def take(self) -> list[Entry]:
        with self._cv:
            entries, self._inbox = self._inbox, []
        return entries

    def inject(self, entries: list[Entry]) -> None:
        """Hand over entries claimed from a dead replica."""
        with self._cv:
            self._inbox.extend(entries)
        self.worker.wake.set()

    def slots_freed(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _run(self) -> None:
        w = self.worker
        s = w.settings
        delay_s = 0.05
        while not self._stop.is_set() and not w.stop_event.is_set():
            with self._cv:
                free = w.free_slots() - len(self._inbox)
                if free <= 0:
                    self._cv.wait(0.1)
                    continue
            try:
                reply = self.client.xreadgroup(
                    keys.WORKERS_GROUP,
                    w.worker_id,
                    {w.in_stream: ">"},
                    count=min(s.read_count, free),
                    block=max(s.block_ms, IDLE_READ_BLOCK_MS),
                )
                delay_s = 0.05
            except ResponseError as e:
                if "NOGROUP" in str(e):
                    ensure_group_sync(self.client, w.in_stream, keys.WORKERS_GROUP)
                    continue
                raise
            except RedisError as e:
                log.warning("reading %s failed, retrying in %.2fs: %r", w.in_stream, delay_s, e)
                self._stop.wait(delay_s)
                delay_s = min(2.0, delay_s * 2)
                continue
            t_ns = time.monotonic_ns()
            entries = [entry for _s, batch in stream_reply(reply) for entry in batch]
            if entries:
                self.inject(entries)
                if w.tracer is not None:
                    for _eid, fields in entries:
                        with contextlib.suppress(Exception):  # malformed: dead-lettered later
                            rid = codec.decode(fields[keys.PAYLOAD_FIELD.encode()])["request_id"]
                            w.tracer.stamp("input_read", str(rid), w.stage_id, t_ns)


class ControlReader:
    """Follows the broadcast control stream (aborts) from the moment the worker started."""

    def __init__(self, worker: StageWorker, client: redis.Redis) -> None:
        self.worker = worker
        self.client = client
        self._lock = threading.Lock()
        self._aborts: list[str] = []
        self.malformed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control-reader", daemon=True)

    def start(self) -> None:
        self._last_id = self._tail_id()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def take(self) -> list[str]:
        with self._lock:
            aborts, self._aborts = self._aborts, []
        return aborts

    def _tail_id(self) -> bytes:
        # Entries of bytes: our clients never use decode_responses (redis-py's stub allows str).
        last = cast("list[Entry]", self.client.xrevrange(self.worker.names.control, count=1))
        return last[0][0] if last else b"0-0"

    def _run(self) -> None:
        w = self.worker
        stream = w.names.control
        delay_s = 0.05
        while not self._stop.is_set() and not w.stop_event.is_set():
            try:
                reply = self.client.xread(
                    {stream: self._last_id},
                    count=w.settings.read_count,
                    block=max(w.settings.block_ms, IDLE_READ_BLOCK_MS),
                )
                delay_s = 0.05
            except RedisError as e:
                log.warning("reading %s failed, retrying in %.2fs: %r", stream, delay_s, e)
                self._stop.wait(delay_s)
                delay_s = min(2.0, delay_s * 2)
                continue
            aborts: list[str] = []
            for _s, entries in stream_reply(reply):
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    try:
                        msg = parse_entry(fields, AbortMsg, w.settings.max_message_bytes)
                    except CodecError as e:
                        # Broadcast, not a group: every worker sees it, so none dead-letters it.
                        self.malformed += 1
                        log.error("malformed control entry %s ignored: %s", entry_id, e)
                        continue
                    aborts.append(msg.request_id)
            if aborts:
                with self._lock:
                    self._aborts.extend(aborts)
                w.wake.set()


class Heartbeat:
    """Keeps `hb:stage:<id>:<worker>` alive and re-claims inputs of replicas that died."""

    def __init__(self, worker: StageWorker, client: redis.Redis) -> None:
        self.worker = worker
        self.client = client
        self.key = worker.names.stage_heartbeat(worker.stage_id, worker.worker_id)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()  # visible before the first read, so nobody takes us for dead
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(RedisError):
            self.client.delete(self.key)

    def beat(self) -> None:
        self.client.set(self.key, self.worker.worker_id, ex=keys.HEARTBEAT_TTL_S)

    def _run(self) -> None:
        interval_s = self.worker.settings.heartbeat_interval_s
        while not self._stop.wait(interval_s):
            try:
                self.beat()
                self.reclaim_orphans()
            except RedisError as e:
                log.warning("heartbeat failed: %r", e)

    def reclaim_orphans(self) -> None:
        """Take over the unacknowledged inputs of consumers whose heartbeat expired."""
        w = self.worker
        summary: Any = self.client.xpending(w.in_stream, keys.WORKERS_GROUP)
        for consumer in summary.get("consumers") or []:
            name = consumer["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name == w.worker_id:
                continue
            if self.client.exists(w.names.stage_heartbeat(w.stage_id, name)):
                continue
            rows = self.client.xpending_range(
                w.in_stream, keys.WORKERS_GROUP, min="-", max="+", count=100, consumername=name
            )
            ids: list[StreamIdT] = [row["message_id"] for row in rows]
            if not ids:
                self.client.xgroup_delconsumer(w.in_stream, keys.WORKERS_GROUP, name)
                continue
            # Without justid XCLAIM returns entries, of bytes for our clients (the stub allows
            # ids only, and str); one whose entry was deleted may come back as (None, None),
            # which inject_claimed drops.
            claimed = cast(
                "list[Entry]",
                self.client.xclaim(
                    w.in_stream,
                    keys.WORKERS_GROUP,
                    w.worker_id,
                    min_idle_time=keys.HEARTBEAT_TTL_S * 1000,
                    message_ids=ids,
                ),
            )
            if claimed:
                log.warning("took over %d input(s) of dead replica %s", len(claimed), name)
                self.inject_claimed(claimed)

    def inject_claimed(self, claimed: list[Entry]) -> None:
        self.worker.reader.inject([(eid, fields) for eid, fields in claimed if fields])
