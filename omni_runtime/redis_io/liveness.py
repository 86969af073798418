"""Who is alive, as Redis tells it: heartbeat discovery, absences, and server restarts.

A heartbeat key that is missing once proves little: Redis may just have come
back empty and the process not yet beaten again. So an absence is timed by the
observer (`Absence`), and Redis losing its data is recognised by a token
vanishing (`StateEpoch`), so the runtime can tell "state lost" apart from
"process gone".
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import redis.asyncio as aioredis

from omni_runtime import keys


class Fence(Protocol):
    """What holds a process's writes while it is not known to be alive and in charge: an
    orchestrator's slot leases (`leases.Leases`) and a worker's stall guard
    (`worker.fence.StallFence`) are the two."""

    async def hold(self) -> bool:
        """Wait until writing is safe: True, or False once it never will be again."""
        ...

    def fresh(self) -> bool:
        """Writing is safe now (`hold` would return True at once)."""
        ...


async def live_heartbeat(client: aioredis.Redis, names: keys.Names, stage_id: int) -> str | None:
    """The key of one worker of `stage_id` that beats its heartbeat (`<ns>:hb:stage:<k>:*`).

    The one place stage replicas are discovered: a key present means a beat younger
    than its TTL. On a Redis Cluster the client is a cluster client, whose SCAN walks
    every primary: a heartbeat lives on the shard of its own slot.
    """
    async for key in client.scan_iter(names.heartbeat_pattern(stage_id), count=1000):
        return key.decode() if isinstance(key, bytes) else str(key)
    return None


async def stage_has_live_replica(client: aioredis.Redis, names: keys.Names, stage_id: int) -> bool:
    """Whether any worker of `stage_id` beats its heartbeat (see `live_heartbeat`)."""
    return await live_heartbeat(client, names, stage_id) is not None


class Replicas:
    """Which stages have a live worker, looked at often and cheaply.

    A SCAN walks the whole keyspace (every primary of a cluster): too dear once a
    second. So one heartbeat key found per stage is remembered and looked at with
    EXISTS, pipelined with the caller's other commands; only a stage whose key is
    gone is scanned again, to find another replica or learn it has none.
    """

    def __init__(self, client: aioredis.Redis, names: keys.Names, stages: int) -> None:
        self.client = client
        self.names = names
        self.known: dict[int, str | None] = dict.fromkeys(range(stages))

    def queue(self, pipe: Any) -> list[tuple[int, str]]:
        """Queue one EXISTS per known key on `pipe`; what was queued, for `settle`."""
        queued = [(sid, key) for sid, key in sorted(self.known.items()) if key is not None]
        for _sid, key in queued:
            pipe.exists(key)
        return queued

    async def settle(
        self, queued: list[tuple[int, str]], replies: Sequence[Any]
    ) -> list[tuple[int, bool]]:
        """(stage, live) for every stage, from `queue`'s replies (SCAN where a key is gone)."""
        alive = {sid for (sid, _key), ok in zip(queued, replies, strict=True) if ok}
        live = []
        for sid in sorted(self.known):
            if sid not in alive:
                self.known[sid] = await live_heartbeat(self.client, self.names, sid)
            live.append((sid, self.known[sid] is not None))
        return live

    async def look(self) -> list[tuple[int, bool]]:
        """(stage, live) for every stage, in one round trip while every stage's key holds."""
        async with self.client.pipeline(transaction=False) as pipe:
            queued = self.queue(pipe)
            replies = await pipe.execute() if queued else []
        return await self.settle(queued, replies)


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
        return await self.lost_given(await self.client.get(self.key))

    async def lost_given(self, seen: bytes | str | None) -> bool:
        """`lost`, given the key's value just read (in the caller's pipeline)."""
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
    when replicas may not have beaten yet. With `holds` (`OMNI_SCALE_TO_ZERO`) no stage is
    ever down: its inputs wait in its stream until an autoscaler starts a replica."""

    def __init__(self, ttl_s: float, now: float, holds: bool = False) -> None:
        self.ttl_s = ttl_s
        self.holds = holds
        self._quiet_until = now + ttl_s
        self.down: set[int] = set()

    def restarted(self, now: float) -> None:
        self._quiet_until = now + self.ttl_s

    def update(self, live: Iterable[tuple[int, bool]], now: float) -> tuple[set[int], set[int]]:
        """One look at every stage: (stages newly down, stages back up)."""
        if now < self._quiet_until or self.holds:
            return set(), set()
        down = {sid for sid, ok in live if not ok}
        new, back = down - self.down, self.down - down
        self.down = down
        return new, back


def no_live_worker(stage_id: int) -> str:
    """The error of a request that needs a stage with no live replica."""
    return f"no live worker for stage {stage_id}"
