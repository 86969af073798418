"""Optional event stamps at the runtime's hand-off points, for benchmarks and timelines.

Off by default: every call site is `if self.tracer is not None: self.tracer.stamp(...)`,
one attribute check. With `OMNI_TRACE_FILE` set, each process appends one line per
event to that file: `<event> <request id> <stage id or -> <CLOCK_MONOTONIC ns>`, a clock
shared by every process on one host, so stamps correlate by request id.

Events (where they are stamped):

- `client_submitted` — a client sent the request;
- `request_read` — the orchestrator read the request from the requests stream;
- `input_submitted` — the orchestrator submitted the request's input to stage k;
- `input_write_start` / `input_written` — the write carrying that input began / ended;
- `input_read` — a worker of stage k read the input (its XREADGROUP returned);
- `output_read` — the orchestrator read an output of stage k (before validation);
- `output_returned` — that output left the stage client for the router.

Clocks: callers stamp with CLOCK_MONOTONIC (`time.monotonic_ns`), which only
compares within one host, so the file trace keeps it. `RedisTracer` (OMNI_TRACE=1)
gathers one request's stamps from processes on many hosts, so it converts each
stamp to wall-clock ns (`time.time_ns` scale) at once, in the stamping process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from redis.exceptions import RedisClusterException, RedisError

from omni_runtime import keys

log = logging.getLogger(__name__)

Stamp = tuple[str, str, int | None, int]
"""`(event, request id, stage id or None, t_ns)`."""


@runtime_checkable
class Closable(Protocol):
    """A tracer (or exporter) holding a file, a thread or a connection to release."""

    def close(self) -> None: ...


@runtime_checkable
class Flushable(Protocol):
    """An OpenTelemetry tracer provider of the SDK (the API's no-op one has no flush)."""

    def force_flush(self, timeout_millis: int = ...) -> bool: ...


class Tracer(Protocol):
    def stamp(
        self, event: str, request_id: str, stage_id: int | None = None, t_ns: int | None = None
    ) -> None:
        """Record `event` for the request at `t_ns` (default: now, CLOCK_MONOTONIC)."""
        ...


class MemoryTracer:
    """Keeps stamps in a list: for tests and in-process benchmarks."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int | None, int]] = []
        self._lock = threading.Lock()

    def stamp(
        self, event: str, request_id: str, stage_id: int | None = None, t_ns: int | None = None
    ) -> None:
        t = time.monotonic_ns() if t_ns is None else t_ns
        with self._lock:
            self.events.append((event, request_id, stage_id, t))


class FileTracer:
    """Appends one line per stamp to a file several processes may share.

    One raw `O_APPEND` descriptor and one `write` per line: lines from several
    threads and processes never interleave, and nothing is buffered at exit.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def stamp(
        self, event: str, request_id: str, stage_id: int | None = None, t_ns: int | None = None
    ) -> None:
        t = time.monotonic_ns() if t_ns is None else t_ns
        stage = "-" if stage_id is None else str(stage_id)
        os.write(self._fd, f"{event} {request_id} {stage} {t}\n".encode())

    def close(self) -> None:
        os.close(self._fd)


def read_trace_file(path: Path) -> list[tuple[str, str, int | None, int]]:
    """The stamps of a `FileTracer` file, as `(event, request id, stage id, t_ns)`."""
    events: list[tuple[str, str, int | None, int]] = []
    for line in path.read_text().splitlines():
        parts = line.split(" ")
        if len(parts) != 4:
            continue
        event, rid, stage, t = parts
        events.append((event, rid, None if stage == "-" else int(stage), int(t)))
    return events


def wall_ns(t_ns: int | None) -> int:
    """A monotonic stamp of this process (None: now) on the wall clock, in ns."""
    if t_ns is None:
        return time.time_ns()
    return t_ns + time.time_ns() - time.monotonic_ns()


class RedisTracer:
    """Records stamps in `<ns>:trace:<request id>` (a list of `event stage t_wall_ns`).

    `stamp` only appends to a bounded queue; a daemon thread writes batches with
    one pipeline (RPUSH, LTRIM to `keys.TRACE_MAX_EVENTS`, EXPIRE), so no caller
    ever waits on Redis. When Redis is down or the queue is full, stamps are
    dropped and counted in `dropped`: a trace is best-effort, the request is not.
    """

    def __init__(
        self,
        client: Any,
        names: keys.Names,
        ttl_s: int = 3600,
        max_queue: int = 100_000,
        batch: int = 2000,
        flush_interval_s: float = 0.05,
        *,
        close_client: bool = False,
    ) -> None:
        self.client, self.names, self.ttl_s = client, names, ttl_s
        self.close_client = close_client
        """`close` closes `client` too: one the tracer was given for its own."""
        self.batch, self.flush_interval_s = batch, flush_interval_s
        self.dropped = 0
        self._queue: deque[Stamp] = deque()
        self._max_queue = max_queue
        self._wake = threading.Event()
        self._closing = False
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-tracer", daemon=True)

    def start(self) -> RedisTracer:
        """Start the writing thread; the tracer itself, for `RedisTracer(...).start()`."""
        self._thread.start()
        return self

    def stamp(
        self, event: str, request_id: str, stage_id: int | None = None, t_ns: int | None = None
    ) -> None:
        if len(self._queue) >= self._max_queue:
            self.dropped += 1
            return
        self._idle.clear()
        self._queue.append((event, request_id, stage_id, wall_ns(t_ns)))  # deque: thread-safe

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every stamp given so far is written (or dropped); False at the timeout."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self._wake.set()
            if self._idle.wait(min(0.1, max(0.0, end - time.monotonic()))) and not self._queue:
                return True
        return False

    def close(self, timeout_s: float = 5.0) -> None:
        self._closing = True
        self._wake.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)
        if self.close_client and not self._thread.is_alive():  # never under a write
            self.client.close()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            while self._queue:
                stamps = [self._queue.popleft() for _ in range(min(self.batch, len(self._queue)))]
                self._write(stamps)
            self._idle.set()
            if self._closing:
                return

    def _write(self, stamps: list[Stamp]) -> None:
        by_request: dict[str, list[str]] = {}
        for event, rid, stage, t in stamps:
            by_request.setdefault(rid, []).append(f"{event} {'-' if stage is None else stage} {t}")
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for rid, lines in by_request.items():
                    key = self.names.trace(rid)
                    pipe.rpush(key, *lines)
                    pipe.ltrim(key, -keys.TRACE_MAX_EVENTS, -1)
                    pipe.expire(key, self.ttl_s)
                pipe.execute()
        except (RedisError, RedisClusterException, OSError) as e:  # Redis, a cluster, a socket
            self.dropped += len(stamps)
            log.warning("dropping %d trace stamps: %r", len(stamps), e)


def read_redis_trace(client: Any, names: keys.Names, request_id: str) -> list[Stamp]:
    """A request's stamps from Redis, in wall-clock ns, sorted by time."""
    out: list[Stamp] = []
    for raw in client.lrange(names.trace(request_id), 0, keys.TRACE_MAX_EVENTS - 1):
        parts = (raw.decode() if isinstance(raw, bytes) else str(raw)).split(" ")
        if len(parts) == 3:
            event, stage, t = parts
            out.append((event, request_id, None if stage == "-" else int(stage), int(t)))
    return sorted(out, key=lambda s: s[3])


class FanOutTracer:
    """Gives every stamp to several tracers (file, Redis, OpenTelemetry)."""

    def __init__(self, tracers: Iterable[Tracer]) -> None:
        self.tracers = list(tracers)

    def stamp(
        self, event: str, request_id: str, stage_id: int | None = None, t_ns: int | None = None
    ) -> None:
        t = time.monotonic_ns() if t_ns is None else t_ns  # one instant for every tracer
        for tracer in self.tracers:
            tracer.stamp(event, request_id, stage_id, t)

    def close(self) -> None:
        for tracer in self.tracers:
            if isinstance(tracer, Closable):
                tracer.close()
