"""Helpers of the orchestrator scenarios: lease settings and a takeover stopwatch."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import redis

from omni_runtime.keys import Names

LEASE_TTL_S = 2.0
ENV = {"OMNI_ORCHESTRATOR_LEASE_TTL_S": str(LEASE_TTL_S)}
"""Short leases, so a scenario's takeover happens within seconds."""


def leases(r: redis.Redis, names: Names) -> dict[int, bytes]:
    """slot → token of every lease held now."""
    slots = sorted(int(m) for m in r.hkeys(names.orchestrator_slots))
    tokens = [cast("bytes | None", r.get(names.orchestrator_lease(s))) for s in slots]
    return {s: t for s, t in zip(slots, tokens, strict=True) if t is not None}


async def wait_for_slots(r: redis.Redis, names: Names, count: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while len(leases(r, names)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} orchestrator slots held")
        await asyncio.sleep(0.05)


class TakeoverClock:
    """Polls the leases from the fault on: when the victim's lease lapsed, and when
    another process's token held it again (the takeover)."""

    def __init__(self, r: redis.Redis, names: Names, before: dict[int, bytes]) -> None:
        self.r, self.names, self.before = r, names, before
        self.lapsed_at: float | None = None
        self.taken_at: float | None = None

    async def run(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        victim: int | None = None
        polled = time.monotonic()
        while time.monotonic() < deadline:
            now_held = await asyncio.to_thread(leases, self.r, self.names)
            now = time.monotonic()
            if victim is None:
                gone = [s for s in self.before if s not in now_held]
                if gone:
                    victim, self.lapsed_at = gone[0], now
                elif [s for s in self.before if now_held[s] != self.before[s]]:
                    # lapsed and taken between two polls: the takeover took at most the gap
                    self.lapsed_at, self.taken_at = polled, now
                    return
            elif now_held.get(victim) not in (None, self.before[victim]):
                self.taken_at = now
                return
            polled = now
            await asyncio.sleep(0.02)

    @property
    def takeover_s(self) -> float | None:
        if self.lapsed_at is None or self.taken_at is None:
            return None
        return self.taken_at - self.lapsed_at
