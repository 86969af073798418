"""What a listener hears of a streamed answer: playback gaps, from arrival times alone.

Playback starts the moment the first audio arrives and then runs in real time. While
the audio received so far is still playing, a later chunk simply queues behind it;
if a chunk arrives after everything before it has played out, the listener heard
silence in between: a gap (a stall), after which playback resumes with that chunk.
Pure arithmetic on (arrival time, seconds of audio) pairs: the client and the
benchmarks feed it, the tests check it with made-up clocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.observe.stats import percentile

AUDIBLE_GAP_S = 0.1
"""A request "plays continuously" when none of its gaps is longer than this."""


def audio_seconds(data: Any, sample_rate: int) -> float:
    """Seconds of mono PCM in one audio output (an array of samples); 0 for anything else."""
    size = getattr(data, "size", None)
    if not isinstance(size, int) or not hasattr(data, "dtype"):
        return 0.0
    return size / sample_rate


@dataclass
class Playback:
    """One request's playback; `add` each audio chunk as it arrives."""

    started_at: float | None = None
    """Arrival of the first audio (None: no audio yet)."""
    plays_until: float = 0.0
    """When the audio received so far will have finished playing."""
    audio_s: float = 0.0
    gaps: list[float] = field(default_factory=list)

    def add(self, t: float, seconds: float) -> float:
        """A chunk of `seconds` of audio arrived at `t`; returns the gap it ended (0 if none).

        An empty chunk plays nothing and neither starts playback nor ends a gap."""
        if seconds <= 0:
            return 0.0
        self.audio_s += seconds
        if self.started_at is None:
            self.started_at = t
            self.plays_until = t + seconds
            return 0.0
        gap = max(0.0, t - self.plays_until)
        self.plays_until = max(self.plays_until, t) + seconds
        if gap > 0:
            self.gaps.append(gap)
        return gap

    @property
    def worst_gap_s(self) -> float:
        return max(self.gaps, default=0.0)

    @property
    def stall_s(self) -> float:
        """Total silence heard between the first audio and the last."""
        return sum(self.gaps)

    @property
    def continuous(self) -> bool:
        return self.worst_gap_s <= AUDIBLE_GAP_S


@dataclass(frozen=True)
class Continuity:
    """A run's summary over its requests with audio."""

    requests: int
    worst_gap_p50_s: float
    worst_gap_p99_s: float
    continuous_share: float
    """Share of requests with no gap over `AUDIBLE_GAP_S` (1.0 when there are none)."""
    stall_s: float
    """Silence heard, summed over every request."""

    @classmethod
    def of(cls, playbacks: Sequence[Playback]) -> Continuity:
        heard = [p for p in playbacks if p.started_at is not None]
        worst = [p.worst_gap_s for p in heard]
        return cls(
            requests=len(heard),
            worst_gap_p50_s=percentile(worst, 50) if worst else 0.0,
            worst_gap_p99_s=percentile(worst, 99) if worst else 0.0,
            continuous_share=(sum(p.continuous for p in heard) / len(heard)) if heard else 1.0,
            stall_s=sum(p.stall_s for p in heard),
        )
