"""Summaries over repetitions and samples, on the runtime's one percentile (nearest rank)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from omni_runtime.observe.stats import percentile

__all__ = ["p50_p99_ms", "percentile", "spread"]


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of the repetitions of one measurement: the table's main cell."""
    return statistics.median(values), min(values), max(values)


def p50_p99_ms(samples_ns: Sequence[float]) -> tuple[float | None, float | None]:
    """p50 and p99 of ns samples, in ms; None for no samples."""
    if not samples_ns:
        return None, None
    return percentile(samples_ns, 50) / 1e6, percentile(samples_ns, 99) / 1e6
