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
- `output_read` — the orchestrator read a finished output of stage k (before validation);
- `output_returned` — that output left the stage client for the router.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Protocol


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


def tracer_for(trace_file: Path | None) -> Tracer | None:
    """The tracer a process shell builds from `Settings.trace_file` (None: tracing off)."""
    return None if trace_file is None else FileTracer(trace_file)
