"""The one percentile of the repository: `omni-runtime bench` and every benchmark use it."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, `q` in [0, 100]; NaN for no values.

    Nearest rank (the smallest value with at least q % of the values at or
    below it), not interpolation: every figure reported is a sample that was
    measured. q=0 is the minimum, q=100 the maximum, and with 20 values p99 is
    the maximum.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
