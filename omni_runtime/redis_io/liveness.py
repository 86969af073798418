"""Who is alive, as Redis tells it: heartbeat discovery, absences, and server restarts.

A heartbeat key that is missing once proves little: Redis may just have come
back empty and the process not yet beaten again. So an absence is timed by the
observer (`Absence`), and Redis losing its data is recognised by a token
vanishing (`StateEpoch`), so the runtime can tell "state lost" apart from
"process gone".
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

import redis.asyncio as aioredis

from omni_runtime import keys


async def stage_has_live_replica(client: aioredis.Redis, names: keys.Names, stage_id: int) -> bool:
    """Whether any worker of `stage_id` beats its heartbeat (`<ns>:hb:stage:<k>:*`).

    The one place stage replicas are discovered: a key present means a beat younger
    than its TTL. On a Redis Cluster the client is a cluster client, whose SCAN walks
    every primary: a heartbeat lives on the shard of its own slot.
    """
    async for _key in client.scan_iter(names.heartbeat_pattern(stage_id), count=1000):
        return True
    return False


class StateEpoch:
    """Whether Redis lost its data since the last look: a token kept under `Names.epoch`.

    A restart alone loses nothing when Redis persists (AOF); an empty one loses every
    stream, group and pending entry, and with them every request in flight. The first
    process to find the token gone writes a new one (SET NX), so every process,
    whenever it looks, sees a token other than the one it remembered.
    """

    def __init__(self, client: aioredis.Redis, key: str) -> None:
        self.client = client
        self.key = key
        self.token: bytes | str | None = None

    async def lost(self) -> bool:
        """True once per loss of Redis's data seen by this process (never on first look)."""
        seen = await self.client.get(self.key)
        if seen is None:
            await self.client.set(self.key, uuid.uuid4().hex, nx=True)
            seen = await self.client.get(self.key)
        before, self.token = self.token, seen
        return before is not None and seen != before


class Absence:
    """First seen missing at t, gone if still missing at t + `ttl_s`; never on first sight.

    Only the names last asked about are remembered, so memory follows what is watched.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._since: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._since)

    def update(self, present: Mapping[str, bool], now: float) -> set[str]:
        """Record one look at every watched name; the names gone by now."""
        for name in list(self._since):
            if name not in present:
                del self._since[name]
        for name, ok in present.items():
            if ok:
                self._since.pop(name, None)
            else:
                self._since.setdefault(name, now)
        return {name for name, t in self._since.items() if now - t >= self.ttl_s}

    def reset(self) -> None:
        """Forget every absence (Redis came back empty: everyone's key vanished at once)."""
        self._since.clear()


class StageWatch:
    """Stages with no live replica. A missing heartbeat key already means silence for a
    whole TTL, so a stage is down on first sight, except within one TTL of a (re)start
    when replicas may not have beaten yet."""

    def __init__(self, ttl_s: float, now: float) -> None:
        self.ttl_s = ttl_s
        self._quiet_until = now + ttl_s
        self.down: set[int] = set()

    def restarted(self, now: float) -> None:
        self._quiet_until = now + self.ttl_s

    def update(self, live: Iterable[tuple[int, bool]], now: float) -> tuple[set[int], set[int]]:
        """One look at every stage: (stages newly down, stages back up)."""
        if now < self._quiet_until:
            return set(), set()
        down = {sid for sid, ok in live if not ok}
        new, back = down - self.down, self.down - down
        self.down = down
        return new, back


def no_live_worker(stage_id: int) -> str:
    """The error of a request that needs a stage with no live replica."""
    return f"no live worker for stage {stage_id}"
