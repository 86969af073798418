"""One registry of counters, histograms and gauges per process: every component counts here.

Components take a `Metrics` (the process shell creates one and passes it down;
an in-process component without one gets a private registry). Names follow
vLLM's conventions in the `omni_` namespace: counters end in `_total`, durations
are histograms in seconds, instantaneous levels are gauges; series may carry
labels (`stage`, `stream`, `group`, `reason`). Exporters read `snapshot()`,
`histograms()` and `gauges()`; nothing here does I/O.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised

log = logging.getLogger(__name__)

LabelKey = tuple[tuple[str, str], ...]

COUNTERS: Mapping[str, str] = {
    "omni_dropped_outputs_total": "Stage outputs dropped: their request had ended or was unknown.",
    "omni_duplicate_outputs_total": "Stage outputs dropped as repeats (sequence number seen).",
    "omni_malformed_entries_total": "Stream entries (and kept responses) that failed validation.",
    "omni_dead_letters_total": "Entries moved to the dead-letter stream.",
    "omni_retries_total": "Redis operations retried after an error.",
    "omni_dropped_writes_total": "Writes given up: after bounded retries, or left when a writer stopped.",
    "omni_chunks_sent_total": "Chunks put for the next stage.",
    "omni_chunks_dropped_total": "Chunks dropped: cancelled, or failed to build or encode.",
    "omni_chunk_put_failures_total": "Chunks whose put failed.",
    "omni_chunks_received_total": "Chunks committed for this stage.",
    "omni_chunk_get_failures_total": "Chunk reads that failed.",
    "omni_malformed_chunks_total": "Chunks that failed to decode or were not chunks.",
    "omni_aborts_total": "Requests aborted, by reason.",
    "omni_requests_completed_total": "Requests a worker finished.",
    "omni_requests_failed_total": "Requests that ended with an error, by stage.",
    "omni_takeovers_total": "Inputs claimed from a replica whose heartbeat expired.",
    "omni_deposed_requests_total": "Requests a stalled replica gave up: another claimed them.",
    "omni_engine_resets_total": "Step engines reset (or rebuilt) after step() raised, by stage.",
    "omni_poison_requests_total": "Requests a stage ended as the cause of its engine's failed steps.",
    "omni_inputs_run_alone_total": (
        "Inputs run alone: delivered again after processes died holding them, by stage."
    ),
    "omni_fenced_outputs_total": "Outputs not published: their input was claimed by another.",
    "omni_orchestrator_takeovers_total": "Orchestrator slots taken over after their lease lapsed.",
    "omni_stage_outputs_total": "Outputs a stage published, by stage.",
    "omni_stage_errors_total": "Stage code failures, by stage.",
    "omni_deadline_exceeded_total": "Requests ended because they outlived their deadline.",
    "omni_requests_received_total": "Requests accepted (by the orchestrator; by serve: submitted).",
    "omni_outputs_lost_total": "Requests a client ended because an output's seq skipped some.",
    "omni_redis_restarts_total": "Redis restarts that lost the state (the epoch key vanished).",
    "omni_stage_down_total": "Times a stage was found with no live replica.",
    "omni_requests_refused_total": "Requests answered with an error at once, by reason.",
    "omni_contained_errors_total": (
        "Unexpected exceptions a loop caught and went on from, by where; "
        "the request concerned ended with one error."
    ),
    "omni_late_successes_total": (
        "Success finals a client got for a request already ended with an error, by its kind."
    ),
    "omni_redis_oom_refusals_total": (
        "Commands Redis refused for memory (maxmemory, noeviction), by source."
    ),
    "omni_responses_unkept_total": (
        "Responses asked to be kept (`store`) that were not: too large, or Redis refused."
    ),
    "omni_background_events_unkept_total": (
        "Events of streamed background responses not kept for their readers: Redis refused."
    ),
    "omni_realtime_turns_total": "Realtime responses started (one runtime request each).",
    "omni_realtime_barge_ins_total": "Realtime responses the user's speech interrupted.",
    "omni_realtime_responses_cancelled_total": (
        "Realtime responses cancelled: barge-in, response.cancel or the client going away."
    ),
}
"""Every counter name the runtime uses, with its help text."""

LATENCY_BUCKETS_S: tuple[float, ...] = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0),
)
"""Request-level durations: from a millisecond to past the default deadline."""
HOP_BUCKETS_S: tuple[float, ...] = (
    *(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01),
    *(0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
"""Hand-offs between processes: a Redis round trip is ~0.1-1 ms."""
GAP_BUCKETS_S: tuple[float, ...] = (0.0, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Playback gaps: 0 is a request heard without a break; 0.1 s is where a gap becomes audible."""


@dataclass(frozen=True)
class HistogramSpec:
    help: str
    buckets: tuple[float, ...]


HISTOGRAMS: Mapping[str, HistogramSpec] = {
    "omni_time_to_first_token_seconds": HistogramSpec(
        "Time from submit to a request's first non-audio output.", LATENCY_BUCKETS_S
    ),
    "omni_time_to_first_audio_seconds": HistogramSpec(
        "Time from submit to a request's first audio output.", LATENCY_BUCKETS_S
    ),
    "omni_e2e_request_latency_seconds": HistogramSpec(
        "Time from submit to a request's final output.", LATENCY_BUCKETS_S
    ),
    "omni_stage_queue_time_seconds": HistogramSpec(
        "Time an input waited in a stage's stream before a worker read it, by stage.",
        LATENCY_BUCKETS_S,
    ),
    "omni_stage_run_time_seconds": HistogramSpec(
        "Time a stage spent on one request, first read to last output, by stage.",
        LATENCY_BUCKETS_S,
    ),
    "omni_chunk_handoff_latency_seconds": HistogramSpec(
        "Time from a chunk's put to its read by the next stage, by stage.", HOP_BUCKETS_S
    ),
    "omni_audio_gap_seconds": HistogramSpec(
        "Per request, the longest silence a listener heard once its audio started (0: none).",
        GAP_BUCKETS_S,
    ),
    "omni_realtime_speech_to_audio_seconds": HistogramSpec(
        "Realtime: from the end of the user's speech (VAD stop or commit) to the answer's "
        "first audio sent.",
        LATENCY_BUCKETS_S,
    ),
    "omni_realtime_session_worst_gap_seconds": HistogramSpec(
        "Realtime, per session: the longest silence within any response's audio (0: none).",
        GAP_BUCKETS_S,
    ),
}
"""Every histogram name, with its help text and bucket upper bounds (seconds)."""

GAUGES: Mapping[str, str] = {
    "omni_stage_inputs_in_flight": "Inputs a worker has read and not finished, by stage.",
    "omni_requests_running": "Requests the orchestrator is routing.",
    "omni_stream_length": "Entries in a stream (XLEN), by stream.",
    "omni_stream_pending_entries": "Entries read and not acknowledged, by stream and group.",
    "omni_stream_oldest_pending_seconds": "Age of the oldest pending entry, by stream and group.",
    "omni_workers_alive": "Workers whose heartbeat key is live, by stage.",
    "omni_stage_backlog_entries": "Inputs no replica has taken yet (the group's lag), by stage.",
    "omni_stage_in_flight": "Inputs replicas have taken and not finished (pending), by stage.",
    "omni_stage_capacity": "Live replicas times each one's max concurrency, by stage.",
    "omni_stage_desired_replicas": (
        "Replicas the stage's load asks for: ceil((backlog + in flight) / target), by stage."
    ),
    "omni_engine_running": "Requests an async engine is running (in its batch), by stage.",
    "omni_engine_waiting": "Requests an async engine holds waiting for a batch slot, by stage.",
    "omni_engine_capacity": "Requests an async engine can run at once (batch slots), by stage.",
    "omni_realtime_sessions_open": "WebSocket sessions open (Realtime and speech streams).",
    "omni_background_queued": (
        "Background responses waiting for a place on this server (max_inflight), not running yet."
    ),
}
"""Every gauge name, with its help text."""


@dataclass(frozen=True)
class HistogramValue:
    """One histogram series: per-bucket (not cumulative) counts, the last one being +Inf."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    def cumulative(self) -> list[tuple[float, int]]:
        """`(upper bound, observations <= it)`, ending with `(inf, count)`."""
        out: list[tuple[float, int]] = []
        total = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out

    def quantile(self, q: float) -> float | None:
        """Estimated like Prometheus' `histogram_quantile`: linear within the bucket."""
        if self.count == 0:
            return None
        rank = q * self.count
        lower, seen = 0.0, 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            if seen + n >= rank and n > 0:
                if bound == float("inf"):
                    return lower
                return lower + (bound - lower) * (rank - seen) / n
            seen += n
            lower = bound
        return lower


def _label_key(labels: Mapping[str, object]) -> LabelKey:
    if len(labels) == 1:  # the series of the hot paths: no sort, no generator
        for name, value in labels.items():
            return ((name, str(value)),)
    if not labels:
        return ()
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


class _Hist:
    __slots__ = ("counts", "sum")

    def __init__(self, n_buckets: int) -> None:
        self.counts = [0] * (n_buckets + 1)
        self.sum = 0.0


class Metrics:
    """Thread-safe series: `inc`, `observe`, `set_gauge` / `gauge_callback`; reads copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[LabelKey, float]] = {}
        self._hists: dict[str, dict[LabelKey, _Hist]] = {}
        self._gauges: dict[str, dict[LabelKey, float]] = {}
        self._callbacks: dict[tuple[str, LabelKey], Callable[[], float | None]] = {}

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown counter {name!r}: declare it in metrics.COUNTERS")
        key = _label_key(labels)
        with self._lock:
            series = self._counts.setdefault(name, {})
            series[key] = series.get(key, 0) + amount

    def value(self, name: str, **labels: object) -> float:
        """The sum over every series of `name` whose labels include `labels`."""
        want = set(_label_key(labels))
        with self._lock:
            series = dict(self._counts.get(name, {}))
        return sum(v for key, v in series.items() if want <= set(key))

    def snapshot(self) -> dict[str, dict[LabelKey, float]]:
        """A copy of every counter series: `{name: {labels: value}}`."""
        with self._lock:
            return {name: dict(series) for name, series in self._counts.items()}

    def observe(self, name: str, value: float, **labels: object) -> None:
        """Count one observation (seconds, for the durations) in histogram `name`."""
        spec = HISTOGRAMS.get(name)
        if spec is None:
            raise KeyError(f"unknown histogram {name!r}: declare it in metrics.HISTOGRAMS")
        key = _label_key(labels)
        slot = bisect.bisect_left(spec.buckets, value)  # le-buckets: value == bound goes in
        with self._lock:
            series = self._hists.setdefault(name, {})
            hist = series.get(key)
            if hist is None:
                hist = series[key] = _Hist(len(spec.buckets))
            hist.counts[slot] += 1
            hist.sum += value

    def histograms(self) -> dict[str, dict[LabelKey, HistogramValue]]:
        """A copy of every histogram series."""
        with self._lock:
            return {
                name: {
                    key: HistogramValue(
                        HISTOGRAMS[name].buckets, tuple(h.counts), h.sum, sum(h.counts)
                    )
                    for key, h in series.items()
                }
                for name, series in self._hists.items()
            }

    def histogram(self, name: str, **labels: object) -> HistogramValue:
        """Every series of `name` whose labels include `labels`, merged into one."""
        want = set(_label_key(labels))
        buckets = HISTOGRAMS[name].buckets
        counts = [0] * (len(buckets) + 1)
        total = 0.0
        for key, h in self.histograms().get(name, {}).items():
            if want <= set(key):
                counts = [a + b for a, b in zip(counts, h.counts, strict=True)]
                total += h.sum
        return HistogramValue(buckets, tuple(counts), total, sum(counts))

    def set_gauge(self, name: str, value: float, **labels: object) -> None:
        self._check_gauge(name)
        key = _label_key(labels)
        with self._lock:
            self._gauges.setdefault(name, {})[key] = value

    def add_gauge(self, name: str, amount: float, **labels: object) -> None:
        """Move a gauge up or down (in-flight counts)."""
        self._check_gauge(name)
        key = _label_key(labels)
        with self._lock:
            series = self._gauges.setdefault(name, {})
            series[key] = series.get(key, 0) + amount

    def gauge_callback(
        self, name: str, fn: Callable[[], float | None], **labels: object
    ) -> Callable[[], None]:
        """Read `fn()` at every `gauges()` (None: no sample); returns its unregister."""
        self._check_gauge(name)
        slot = (name, _label_key(labels))
        with self._lock:
            self._callbacks[slot] = fn

        def unregister() -> None:
            with self._lock:
                self._callbacks.pop(slot, None)

        return unregister

    def remove_gauges(self, name: str, keep: Sequence[LabelKey] = ()) -> None:
        """Forget the series of `name` not in `keep` (a stream or worker that went away)."""
        with self._lock:
            series = self._gauges.get(name, {})
            for key in [k for k in series if k not in keep]:
                del series[key]

    def gauges(self) -> dict[str, dict[LabelKey, float]]:
        """Set values and callbacks' current values (callbacks run outside the lock)."""
        with self._lock:
            out = {name: dict(series) for name, series in self._gauges.items()}
            callbacks = list(self._callbacks.items())
        for (name, key), fn in callbacks:
            value = foreign.call(fn)  # handed in (an engine's count among them)
            if isinstance(value, Raised):  # a broken callback must not break the scrape
                log.warning("gauge %s%s callback failed: %r", name, dict(key), value.error)
                continue
            if value is not None:
                out.setdefault(name, {})[key] = float(value)
        return out

    def gauge(self, name: str, **labels: object) -> float | None:
        return self.gauges().get(name, {}).get(_label_key(labels))

    @staticmethod
    def _check_gauge(name: str) -> None:
        if name not in GAUGES:
            raise KeyError(f"unknown gauge {name!r}: declare it in metrics.GAUGES")
