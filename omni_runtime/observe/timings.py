"""Request- and stage-level durations, measured where the runtime already sees the events.

`RequestTimer` lives in the orchestrator (every output of a request passes
through it): time to first token, to first audio, end to end. (Playback gaps need the
audio's duration and the listener's clock: `OmniClient.stream` measures them.) `StageTimer` lives in a worker: queue time (from the
input entry's id, which Redis stamps with its own clock, to the read), run
time, inputs in flight, outputs and errors. Both are bounded and thread-safe
enough for their one owner thread; neither does I/O.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from omni_runtime.observe.metrics import Metrics
from omni_runtime.wire import codec

MAX_OPEN = 100_000
"""Requests timed at once; past it the oldest is forgotten (its end is not observed)."""


def is_audio(data: Any) -> bool:
    """An array output (numpy or alike, or the bytes of one as read) is audio; anything
    else counts as a token."""
    if isinstance(data, msgspec.Raw):
        return codec.is_array(data)
    return hasattr(data, "dtype") and hasattr(data, "shape")


@dataclass
class _Open:
    start: float
    first_token: bool = False
    first_audio: bool = False


class RequestTimer:
    """Call `started` when a request is read, `output` for each output sent to its client."""

    def __init__(self, metrics: Metrics, max_open: int = MAX_OPEN) -> None:
        self.metrics = metrics
        self.max_open = max_open
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self.ended_total = 0
        """Requests whose last output went out (the process's heartbeat: `status`)."""

    def started(self, request_id: str, t: float | None = None) -> None:
        """`t`: time.monotonic() when the request was read (default now)."""
        self._open[request_id] = _Open(time.monotonic() if t is None else t)
        self.metrics.inc("omni_requests_received_total")
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)

    def output(
        self, request_id: str, data: Any, finished: bool, error: str | None, t: float | None = None
    ) -> None:
        """One output delivered to the client; a `finished` one is the request's last."""
        req = self._open.get(request_id)
        if req is None:
            return
        now = time.monotonic() if t is None else t
        if error is None and data is not None and not (req.first_audio and req.first_token):
            if is_audio(data):
                if not req.first_audio:
                    req.first_audio = True
                    self.metrics.observe("omni_time_to_first_audio_seconds", now - req.start)
            elif not req.first_token:
                req.first_token = True
                self.metrics.observe("omni_time_to_first_token_seconds", now - req.start)
        if finished:
            self.ended(request_id, now)

    def ended(self, request_id: str, t: float | None = None) -> None:
        """The request's last output (its final result, error, abort or deadline) went out."""
        req = self._open.pop(request_id, None)
        if req is not None:
            self.ended_total += 1
            now = time.monotonic() if t is None else t
            self.metrics.observe("omni_e2e_request_latency_seconds", now - req.start)

    def running_count(self) -> float:
        """For `metrics.gauge_callback("omni_requests_running", timer.running_count)`."""
        return float(len(self._open))


def entry_age_s(entry_id: bytes | str, now_s: float | None = None) -> float:
    """Seconds since Redis created a stream entry (its id's ms part), never negative."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    created_s = int(raw.split("-", 1)[0]) / 1000
    return max(0.0, (time.time() if now_s is None else now_s) - created_s)


class StageTimer:
    """A worker's per-stage series: call `read`, then `output` per output, `done` at the end."""

    def __init__(self, metrics: Metrics, stage_id: int, max_open: int = MAX_OPEN) -> None:
        self.metrics = metrics
        self.stage = stage_id
        self.max_open = max_open
        self._started: OrderedDict[str, float] = OrderedDict()
        # Read when scraped, not moved twice per request (~5 % of a light stage's CPU).
        metrics.gauge_callback(
            "omni_stage_inputs_in_flight", lambda: len(self._started), stage=stage_id
        )

    def read(self, request_id: str, entry_id: bytes | str) -> None:
        self.metrics.observe(
            "omni_stage_queue_time_seconds", entry_age_s(entry_id), stage=self.stage
        )
        self._started[request_id] = time.monotonic()
        while len(self._started) > self.max_open:
            self._started.popitem(last=False)

    def output(self, error: str | None = None) -> None:
        self.metrics.inc("omni_stage_outputs_total", stage=self.stage)
        if error is not None:
            self.metrics.inc("omni_stage_errors_total", stage=self.stage)

    def done(self, request_id: str) -> None:
        """The request's last output is published (or it was aborted)."""
        start = self._started.pop(request_id, None)
        if start is not None:
            self.metrics.observe(
                "omni_stage_run_time_seconds", time.monotonic() - start, stage=self.stage
            )
