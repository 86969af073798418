"""Orchestrator slots: leases that say who serves which slot, and the fence writes pass.

A slot (0, 1, 2, …) is a lease key holding one process's token with a TTL. Whoever
holds it reads the slot's consumer backlog and owns its requests. The lease is kept
by one transaction per round that reads and extends it (its reply proves it held;
a lease found another's deposes this process; while Redis is out of memory, which
refuses every command inside a MULTI, by the same commands without one), and is set
again only by a
check-and-set transaction (WATCH, compare, SET), so a process never takes back a
lease another has taken. A key that vanished (it lapsed,
or Redis came back empty) is taken back only if nobody took it meanwhile: every take
counts up the slot's generation, and the holder's own count must still be there (or
none at all: Redis lost everything, and the process's requests end as after any
empty restart). A slot served by another and given back is lost to its old holder.

Time alone cannot stop a batch that passed the fence just before its process
stalled: it would go out on waking. So a takeover also closes the previous holder's
connections (CLIENT KILL by the name every orchestrator connection carries) before
reading the slot's state: what that holder sent before is in Redis, what it sends
after fails, and its retry meets the fence. Where the ACL user may not kill clients,
the takeover logs it once and relies on the time fence alone.

The fence is time: a refresh round that kept every lease, started at t, proves them
held until t + TTL at least. Writes and reads pass `hold()` only before
t + TTL * `FRESH_FRACTION`; a stalled process (SIGSTOP, a long pause) therefore
waits for its next round on waking, and gives up for good once a round finds a
lease taken: nothing it queued while deposed reaches Redis.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError, RedisError, WatchError

from omni_runtime import keys
from omni_runtime.errors import FatalError
from omni_runtime.redis_io.clients import is_cluster

log = logging.getLogger(__name__)

FRESH_FRACTION = 0.75
"""Share of the TTL after a round's start during which the leases count as held."""
MAX_SLOTS = keys.MAX_SLOTS
RELEASE_ATTEMPTS = 3


class LeaseLost(FatalError):
    """Another process holds a slot this one believed its own."""


class Leases:
    """The slots this process holds (`held`), their renewal, and its write fence."""

    def __init__(
        self,
        client: aioredis.Redis,
        names: keys.Names,
        ttl_s: float,
        token: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`token`: this process's name in the leases (default: random); unique to it."""
        self.client = client
        self.names = names
        self.ttl_s = ttl_s
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.clock = clock
        self.token = token or uuid.uuid4().hex
        self.client_name = names.orchestrator_connection(self.token)
        """Set on every connection of the process's client (`CLIENT SETNAME`)."""
        self._kill_refused = False
        self.can_disconnect = not is_cluster(client)
        """False where connections cannot be named (a cluster client): time fence only."""
        self.held: set[int] = set()
        self.generation: dict[int, int] = {}
        """slot → the generation this process's take of it got."""
        self.lost = False
        self._kept_at = float("-inf")
        """Start of the last round that kept every held lease."""
        self._changed = asyncio.Event()

    @property
    def age_s(self) -> float:
        return self.clock() - self._kept_at

    def fresh(self) -> bool:
        return not self.lost and self.age_s < self.ttl_s * FRESH_FRACTION

    def read_block_ms(self) -> int:
        """How long a blocking read may wait: until the fence closes, at least 1 ms.

        A read issued while the leases are fresh then never outlives them, so an
        idle holder's readers wake once per renewal or two, not every `block_ms`,
        and a read never takes an entry after its slot could have been taken over.
        Every read waiting now ends at the same moment: one wake for them all.
        """
        left_s = self.ttl_s * FRESH_FRACTION - self.age_s
        return max(1, int(left_s * 1000)) if left_s > 0 else 1

    async def hold(self) -> bool:
        """Wait until the leases are known fresh (True), or lost (False)."""
        while not self.fresh():
            if self.lost:
                return False
            self._changed.clear()
            await self._changed.wait()
        return True

    async def take_lowest_free(self) -> int:
        """The lowest slot nobody holds, taken: a process's home slot."""
        for slot in itertools.count():
            if slot >= MAX_SLOTS:
                raise RuntimeError(f"no free orchestrator slot below {MAX_SLOTS}")
            if await self.take(slot):
                return slot
        raise AssertionError("unreachable")

    async def take(self, slot: int) -> bool:
        """SET NX: True if the slot is now this process's. A process that gave its slots up
        (`shut`) or was deposed takes none: a slot it just released, still worth taking,
        would be its own again until its lease lapsed, a TTL after the process exited."""
        if self.lost:
            return False
        started = self.clock()
        registry = self.names.orchestrator_slots
        previous = await self.client.hget(registry, str(slot))
        if not await self.client.set(
            self.names.orchestrator_lease(slot), self.token, nx=True, px=self.ttl_ms
        ):
            return False
        gen_key = self.names.orchestrator_generation(slot)
        self.generation[slot] = int(await self.client.incr(gen_key))
        await self.client.hset(registry, str(slot), self.token)
        if previous is not None and not self._mine(previous):
            await self._disconnect(previous.decode() if isinstance(previous, bytes) else previous)
        if not self.held:
            self._kept_at = started
        self.held.add(slot)
        self._changed.set()
        return True

    async def refresh(self) -> set[int] | None:
        """One renewal round over every held slot: the slots the registry knows, None if
        none held. Raises `LeaseLost` (and fences for good) if one is held by another. A
        Redis error leaves the fence closing on time.

        One round trip while every lease is there: a transaction reads each lease and
        extends it at once, so its reply proves them ours (a lease found to be another's
        was extended too, as its holder does every round; this process stops). A lease
        found gone, or the registry missing one, takes the careful round (`_refresh_watched`).
        """
        if not self.held:
            return None
        started = self.clock()
        slots = sorted(self.held)
        try:
            replies = await self._round(slots, transaction=True)
        except OutOfMemoryError:
            # Redis out of memory refuses every command queued in a MULTI, even a GET: the
            # round again without one. Its few commands arrive in one read, which Redis
            # runs without another client's between them; and while Redis refuses writes
            # for memory, nobody can SET a lapsed lease anyway.
            replies = await self._round(slots, transaction=False)
        values, known = replies[0:-1:2], {int(m) for m in replies[-1]}
        taken = [s for s, v in zip(slots, values, strict=True) if not self._mine(v)]
        if taken:
            self._lose(taken)
        if any(v is None for v in values) or not known >= self.held:
            return await self._refresh_watched(started)
        self._kept_at = started
        self._changed.set()
        return known

    async def _round(self, slots: list[int], transaction: bool) -> list[Any]:
        """GET and PEXPIRE of each lease, then the registry's slots."""
        async with self.client.pipeline(transaction=transaction) as pipe:
            for slot in slots:
                pipe.get(self.names.orchestrator_lease(slot))
                pipe.pexpire(self.names.orchestrator_lease(slot), self.ttl_ms)
            pipe.hkeys(self.names.orchestrator_slots)
            return list(await pipe.execute())

    async def _refresh_watched(self, started: float) -> set[int] | None:
        """The check-and-set round (WATCH, MGET, the transaction) that may set a lapsed
        lease again, if nobody took it meanwhile, and names the held slots in the
        registry again (Redis may have lost it)."""
        slots = sorted(self.held)
        lease_keys = [self.names.orchestrator_lease(s) for s in slots]
        gen_keys = [self.names.orchestrator_generation(s) for s in slots]
        registry = self.names.orchestrator_slots
        for _attempt in range(3):
            try:
                async with self.client.pipeline(transaction=True) as pipe:
                    await pipe.watch(*lease_keys, *gen_keys)
                    # One GET each (this round is rare): a cluster client's watched
                    # pipeline refuses MGET, and a failover longer than the TTL comes here.
                    got = [await pipe.get(key) for key in (*lease_keys, *gen_keys)]
                    values, gens = got[: len(slots)], got[len(slots) :]
                    taken = [
                        s
                        for s, v, g in zip(slots, values, gens, strict=True)
                        if not self._mine(v)
                        or (v is None and g is not None and int(g) != self.generation[s])
                    ]
                    if taken:
                        self._lose(taken)
                    pipe.multi()
                    for slot, key, value, gen in zip(slots, lease_keys, values, gens, strict=True):
                        pipe.hset(registry, str(slot), self.token)
                        if value is not None:
                            pipe.pexpire(key, self.ttl_ms)
                            continue
                        pipe.set(key, self.token, px=self.ttl_ms)  # lapsed: nobody took it since
                        if gen is None:  # Redis lost its data: the count starts again here
                            pipe.set(
                                self.names.orchestrator_generation(slot), self.generation[slot]
                            )
                    pipe.hkeys(registry)
                    replies = await pipe.execute()
                self._kept_at = started
                self._changed.set()
                return {int(m) for m in replies[-1]}
            except WatchError:
                continue  # a key changed between WATCH and EXEC: look again
        log.warning("lease renewal kept racing; retrying next round")
        return None

    def _mine(self, value: bytes | str | None) -> bool:
        """The lease holds this process's token, or none (lapsed)."""
        return value is None or _text(value) == self.token

    def shut(self) -> None:
        """Nothing more is written from now (the slots are being given back): the next
        holder owns them."""
        self.lost = True

    def _lose(self, slots: list[int]) -> None:
        self.lost = True
        self._changed.set()
        raise LeaseLost(f"orchestrator slot(s) {slots} taken over by another process")

    async def release(self, slot: int) -> None:
        """Give a slot up (compare and delete), with a notice on the released stream in the
        same transaction: a live process that follows it (`follow_releases`) takes the slot
        over at once, not at its next lease round.

        A change of the key between WATCH and EXEC is looked at again: this process's own
        renewal round, in flight on another connection, extends it too, and a release lost
        to that left the slot to lapse a whole TTL later."""
        self.held.discard(slot)
        self.generation.pop(slot, None)
        await self._give_up(slot, self.token)

    async def release_dead(self, token: str) -> list[int]:
        """Give up, as it would have, every slot of the process `token` names, which has
        exited (its supervisor saw it, `--replaces`): live processes, this one too (its home
        slot the lowest free), take them at once rather than once its leases lapsed; its
        process heartbeat goes too (`status`). Never given a live process's token."""
        registry: dict[Any, Any] = await self.client.hgetall(self.names.orchestrator_slots)
        slots = sorted(int(slot) for slot, holder in registry.items() if _text(holder) == token)
        for slot in slots:
            await self._give_up(slot, token)
        await self.client.delete(self.names.orchestrator_process_heartbeat(token))
        if slots:
            log.warning("orchestrator %s exited: its slot(s) %s given up", token, slots)
        return slots

    async def _give_up(self, slot: int, token: str) -> None:
        key = self.names.orchestrator_lease(slot)
        released = self.names.orchestrator_released
        for _attempt in range(RELEASE_ATTEMPTS):
            async with self.client.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(key)
                    if _text(await pipe.get(key)) not in (token, None):
                        return  # it changed hands meanwhile: not ours to delete
                    pipe.multi()
                    pipe.delete(key)
                    pipe.xadd(released, {"slot": slot}, maxlen=keys.RELEASED_MAXLEN)
                    pipe.expire(released, keys.RELEASED_TTL_S)
                    await pipe.execute()
                    return
                except WatchError:
                    continue
        log.warning("giving orchestrator slot %d back kept racing: it lapses on its own", slot)

    async def follow_releases(self, notice: Callable[[], None], block_ms: int) -> None:
        """Call `notice` whenever some process gives a slot up; runs until cancelled. One
        blocking read at a time, each at most `block_ms` (under the client's socket timeout),
        from the stream's last entry when it started: a notice is never missed between reads."""
        stream = self.names.orchestrator_released
        newest: Any = await self.client.xrevrange(stream, count=1)
        last: Any = newest[0][0] if newest else b"0-0"
        while True:
            got: Any = await self.client.xread({stream: last}, count=keys.RELEASED_MAXLEN,
                                               block=block_ms)  # fmt: skip
            if got:
                last = got[0][1][-1][0]
                notice()

    async def _disconnect(self, token: str) -> None:
        """Close every connection of the process that held a slot before (see above)."""
        name = self.names.orchestrator_connection(token)
        if not self.can_disconnect:
            return
        try:
            for conn in await self.client.client_list():
                if conn.get("name") == name:
                    await self.client.client_kill_filter(_id=conn["id"])
        except RedisError as e:
            if not self._kill_refused:
                log.warning("cannot close a deposed orchestrator's connections: %r", e)
            self._kill_refused = True

    async def lapsed(self, known: set[int] | None = None) -> list[int]:
        """Known slots with no lease and not held here: candidates for a takeover.
        `known`: the registry's slots if just read (`refresh`), else read here."""
        if known is None:
            known = {int(m) for m in await self.client.hkeys(self.names.orchestrator_slots)}
        slots = sorted(s for s in known if s not in self.held)
        if not slots:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for s in slots:
                pipe.exists(self.names.orchestrator_lease(s))
            present = await pipe.execute()
        return [s for s, ok in zip(slots, present, strict=True) if not ok]

    async def others_alive(self) -> bool:
        """Whether another process holds any slot (so shared keys are not ours to clear)."""
        members = await self.client.hkeys(self.names.orchestrator_slots)
        slots = [int(m) for m in members if int(m) not in self.held]
        if not slots:
            return False
        return bool(await self.client.exists(*(self.names.orchestrator_lease(s) for s in slots)))


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
