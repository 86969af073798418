"""A CPU-bound stage for `benchmarks/capacity.py`: each request costs a fixed CPU time."""

from __future__ import annotations

import time
from typing import Any


def burn(data: Any, cpu_ms: float = 2.0) -> Any:
    """Spin for `cpu_ms` of this thread's CPU time (not wall time: a capped process is
    paused now and then, and the work per request must not change with the cap)."""
    end = time.thread_time() + cpu_ms / 1000
    while time.thread_time() < end:
        pass
    return data
