"""One registry of counters per process: every component counts here, tests read it here.

Components take a `Metrics` (the process shell creates one and passes it down;
an in-process component without one gets a private registry). Counters are
named in the `omni_` namespace and may carry labels (`stage`, `stream`,
`reason`). Exporters read `snapshot()`; nothing here does I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

LabelKey = tuple[tuple[str, str], ...]

COUNTERS: Mapping[str, str] = {
    "omni_dropped_outputs_total": "Stage outputs dropped: their request had ended or was unknown.",
    "omni_duplicate_outputs_total": "Stage outputs dropped as repeats (sequence number seen).",
    "omni_malformed_entries_total": "Stream entries that failed validation.",
    "omni_dead_letters_total": "Entries moved to the dead-letter stream.",
    "omni_retries_total": "Redis operations retried after an error.",
    "omni_dropped_writes_total": "Writes given up after bounded retries.",
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
    "omni_outputs_lost_total": "Requests a client ended because an output's seq skipped some.",
    "omni_redis_restarts_total": "Redis restarts seen (server run_id changed): state was lost.",
    "omni_stage_down_total": "Times a stage was found with no live replica.",
    "omni_requests_refused_total": "Requests answered with an error at once, by reason.",
}
"""Every counter name the runtime uses, with its help text."""


def _label_key(labels: Mapping[str, object]) -> LabelKey:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


class Metrics:
    """Thread-safe counters: `inc(name, n, **labels)`, `value(name, **labels)`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[LabelKey, float]] = {}

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
        """A copy of every series: `{name: {labels: value}}`."""
        with self._lock:
            return {name: dict(series) for name, series in self._counts.items()}
