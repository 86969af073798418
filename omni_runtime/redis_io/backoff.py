"""One retry policy for every Redis loop: exponential delays from redis-py, bounded or not.

Readers retry for as long as the process lives (a Redis outage must not kill a
worker); writers give up after `max_attempts` and report the loss, so a request
ends with an error instead of a scheduler retrying forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redis.backoff import ExponentialBackoff


@dataclass(slots=True)
class Backoff:
    """Delays `initial_s`, 2·`initial_s`, … capped at `max_s`; `None` once `max_attempts` failed."""

    initial_s: float = 0.01
    max_s: float = 2.0
    max_attempts: int | None = None
    failures: int = 0
    _policy: ExponentialBackoff = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._policy = ExponentialBackoff(cap=self.max_s, base=self.initial_s)

    def failed(self) -> float | None:
        """Count one failure; the delay before the next attempt, or None to give up."""
        self.failures += 1
        if self.max_attempts is not None and self.failures >= self.max_attempts:
            return None
        return float(self._policy.compute(self.failures - 1))

    def succeeded(self) -> None:
        self.failures = 0

    def budget_s(self) -> float:
        """How long this policy retries in all, from its first failure to giving up
        (≈ 25 s with the settings' defaults; unbounded: infinite)."""
        if self.max_attempts is None:
            return float("inf")
        fresh = Backoff(self.initial_s, self.max_s, self.max_attempts)
        total = 0.0
        while (delay := fresh.failed()) is not None:
            total += delay
        return total


@dataclass(frozen=True, slots=True)
class RetrySettings:
    """The retry settings (`OMNI_RETRY_*`), taken by a process shell (`Settings.part`) and
    handed to each part that retries; every loop draws its own `Backoff` from them."""

    retry_initial_s: float
    retry_max_s: float
    retry_attempts: int

    def backoff(self, bounded: bool = False) -> Backoff:
        """The retry policy of one loop: bounded for writes, unbounded for reads."""
        attempts = self.retry_attempts if bounded else None
        return Backoff(self.retry_initial_s, self.retry_max_s, attempts)
