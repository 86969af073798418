"""Children that stopped beating: alive, their heartbeat key gone for `STALL_TTLS` TTLs.

A process whose threads all stopped (SIGSTOP, or a native call that hangs holding the
GIL, which stops its watchdog too: `watchdog.py` ends a wedged loop, not a wedged
interpreter) keeps its pid and never exits, so `ProcessGroup.restart_dead` would wait on
it for good, and the requests its stage holds with it. A live process beats every
`OMNI_HEARTBEAT_INTERVAL_S`; one whose key has been missing for `STALL_TTLS` TTLs (10 s
by default, 15 s after its last beat), having beaten before, is taken for stalled, to be
killed and started again in its place. A process still loading its model has not beaten
yet and is left alone; Redis that lost its keys (an empty restart) sees every live
process beat again within an interval; Redis out of reach tells nothing, and nothing is
judged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from redis.exceptions import RedisError

STALL_TTLS = 2
"""Heartbeat TTLs a live process's key may be missing before it counts as stalled."""


class StallWatch:
    """Which processes, by their heartbeat keys, stopped beating while alive."""

    def __init__(
        self, client: Any, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.client = client
        self.stall_s = STALL_TTLS * ttl_s
        self.clock = clock
        self._seen: set[str] = set()
        """Keys that were there once: their process was ready."""
        self._missing_since: dict[str, float] = {}

    def stalled(self, keys: Mapping[str, str]) -> list[str]:
        """Of `keys` (a live process's name → its heartbeat key), those stalled now."""
        names = list(keys)
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.exists(keys[name])
                present = pipe.execute()
        except RedisError:
            return []
        now = self.clock()
        found = []
        for name, here in zip(names, present, strict=True):
            key = keys[name]
            if here:
                self._seen.add(key)
                self._missing_since.pop(key, None)
            elif key in self._seen:
                since = self._missing_since.setdefault(key, now)
                if now - since >= self.stall_s:
                    found.append(name)
        return found

    def missing_for_s(self, key: str) -> float:
        return self.clock() - self._missing_since.get(key, self.clock())
