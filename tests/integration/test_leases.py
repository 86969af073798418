"""Orchestrator leases and the write fence, over fakeredis with a hand-driven clock."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest

from omni_runtime.keys import Names
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.start import Observability
from omni_runtime.orchestrator.leases import LeaseLost, Leases
from omni_runtime.redis_io.writer import StreamWriter

pytestmark = pytest.mark.timeout(30)

NAMES = Names("t")
TTL_S = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def redis() -> fakeredis.FakeAsyncRedis:
    return fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())


async def test_each_process_takes_the_lowest_free_slot(redis: fakeredis.FakeAsyncRedis) -> None:
    a, b = Leases(redis, NAMES, TTL_S), Leases(redis, NAMES, TTL_S)
    assert await a.take_lowest_free() == 0
    assert await b.take_lowest_free() == 1
    assert await redis.get(NAMES.orchestrator_lease(0)) == a.token.encode()
    assert 0 < await redis.pttl(NAMES.orchestrator_lease(1)) <= TTL_S * 1000
    assert await a.lapsed() == [] and await b.others_alive()


async def test_a_taken_lease_deposes_its_old_holder_for_good(
    redis: fakeredis.FakeAsyncRedis,
) -> None:
    clock = Clock()
    a = Leases(redis, NAMES, TTL_S, clock=clock)
    b = Leases(redis, NAMES, TTL_S)
    await a.take(0)
    assert await a.hold()
    await redis.delete(NAMES.orchestrator_lease(0))  # lapsed while `a` stalled
    assert await b.lapsed() == [0]
    assert await b.take(0)
    with pytest.raises(LeaseLost):
        await a.refresh()
    assert not a.fresh() and not await a.hold()
    assert await redis.get(NAMES.orchestrator_lease(0)) == b.token.encode()


async def test_a_slot_served_by_another_and_given_back_is_not_taken_back(
    redis: fakeredis.FakeAsyncRedis,
) -> None:
    a, b = Leases(redis, NAMES, TTL_S), Leases(redis, NAMES, TTL_S)
    await a.take(0)
    await redis.delete(NAMES.orchestrator_lease(0))
    await b.take(0)
    await b.release(0)  # served and given back: the key is gone again
    with pytest.raises(LeaseLost):
        await a.refresh()
    assert await redis.get(NAMES.orchestrator_lease(0)) is None


async def test_a_release_racing_its_own_renewal_still_gives_the_slot_back(
    redis: fakeredis.FakeAsyncRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process's renewal round extends the lease between the release's WATCH and EXEC
    (two connections of one process): the release looks again, and the slot is free now,
    not a TTL later."""
    a = Leases(redis, NAMES, TTL_S)
    await a.take(0)
    lease = NAMES.orchestrator_lease(0)
    renewals: list[bool] = []
    pipeline = redis.pipeline

    def renewed_meanwhile(transaction: bool = True) -> object:
        pipe = pipeline(transaction=transaction)
        get = pipe.get

        async def get_then_renew(key: str) -> object:
            value = await get(key)
            if not renewals:  # the first look only: the renewal round lands after it
                renewals.append(await redis.pexpire(lease, int(TTL_S * 1000)))
            return value

        monkeypatch.setattr(pipe, "get", get_then_renew)
        return pipe

    monkeypatch.setattr(redis, "pipeline", renewed_meanwhile)
    await a.release(0)
    assert renewals == [True]
    assert not await redis.exists(lease)
    assert await redis.xlen(NAMES.orchestrator_released) == 1  # the notice went out once


async def test_a_process_that_gave_its_slots_up_takes_none_back(
    redis: fakeredis.FakeAsyncRedis,
) -> None:
    """A wedged orchestrator gives its slots back and exits; its lease round, still
    running, found the slot it had just released lapsed and took it again (its own release
    notice woke it), so the live process waited a whole TTL for it."""
    a, b = Leases(redis, NAMES, TTL_S), Leases(redis, NAMES, TTL_S)
    await a.take(1)
    a.shut()
    await a.release(1)
    assert await a.lapsed() == [1]
    assert not await a.take(1)
    assert await redis.get(NAMES.orchestrator_lease(1)) is None
    assert await b.take(1)


async def test_a_lapsed_lease_nobody_took_is_kept(redis: fakeredis.FakeAsyncRedis) -> None:
    a = Leases(redis, NAMES, TTL_S)
    await a.take(0)
    await redis.delete(NAMES.orchestrator_lease(0))
    await a.refresh()
    assert await redis.get(NAMES.orchestrator_lease(0)) == a.token.encode()
    await redis.flushall()  # Redis came back empty: the generation is gone too
    await a.refresh()
    assert await redis.get(NAMES.orchestrator_lease(0)) == a.token.encode()


async def test_the_writer_holds_while_the_lease_is_stale_and_refuses_once_lost(
    redis: fakeredis.FakeAsyncRedis,
) -> None:
    clock = Clock()
    a = Leases(redis, NAMES, TTL_S, clock=clock)
    await a.take(0)
    metrics = Metrics()
    writer = StreamWriter(redis, 1000, obs=Observability(metrics), fence=a)
    task = asyncio.create_task(writer.run())
    writer.xadd("s", {"m": b"1"})
    await writer.written()
    assert await redis.xlen("s") == 1
    clock.now += TTL_S  # stalled past the fence: the next batch waits
    writer.xadd("s", {"m": b"2"})
    held = asyncio.create_task(writer.written())
    done, _ = await asyncio.wait({held}, timeout=0.05)  # held back: not written meanwhile
    assert not done and await redis.xlen("s") == 1
    await a.refresh()  # kept after all: it goes out
    assert await held and await redis.xlen("s") == 2
    clock.now += TTL_S
    writer.xadd("s", {"m": b"3"})
    refused = asyncio.create_task(writer.written())
    await redis.set(NAMES.orchestrator_lease(0), "someone else")
    with pytest.raises(LeaseLost):
        await a.refresh()
    assert await refused is False
    assert await redis.xlen("s") == 2 and writer.dropped_writes == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_round_renews_and_names_every_slot_the_registry_knows(
    redis: fakeredis.FakeAsyncRedis,
) -> None:
    a, b = Leases(redis, NAMES, TTL_S), Leases(redis, NAMES, TTL_S)
    await a.take(0)
    await b.take(1)
    await redis.pexpire(NAMES.orchestrator_lease(0), 100)
    assert await a.refresh() == {0, 1}
    assert await redis.pttl(NAMES.orchestrator_lease(0)) > 100
    await redis.delete(NAMES.orchestrator_slots)  # lost (Redis came back with less)
    assert await a.refresh() == {0}
    assert await redis.hget(NAMES.orchestrator_slots, "0") == a.token.encode()
    assert await a.lapsed(await a.refresh()) == []


async def test_reads_block_no_longer_than_the_fence_stays_open(
    redis: fakeredis.FakeAsyncRedis,
) -> None:
    """A read issued while the leases are fresh ends before the slot could be taken."""
    clock = Clock()
    a = Leases(redis, NAMES, TTL_S, clock=clock)
    await a.take(0)
    assert a.read_block_ms() == int(TTL_S * 0.75 * 1000)
    clock.now += TTL_S / 2
    assert a.read_block_ms() == int(TTL_S * 0.25 * 1000)
    clock.now += TTL_S  # stale: the caller's `hold()` waits; a read never blocks forever (0)
    assert a.read_block_ms() == 1
    await a.refresh()
    assert a.read_block_ms() == int(TTL_S * 0.75 * 1000)


async def test_a_dead_processs_slots_are_given_up_for_it_and_no_live_ones(
    redis: fakeredis.FakeAsyncRedis,
) -> None:
    """A supervisor that saw an orchestrator exit starts another with `--replaces`: the
    dead one's slots are free at once (with a notice for live processes), not a TTL later;
    a slot another process holds meanwhile stays its own."""
    dead = Leases(redis, NAMES, TTL_S, token="dead")
    live = Leases(redis, NAMES, TTL_S, token="live")
    await dead.take(0)
    await dead.take(2)
    await live.take(1)
    await redis.delete(NAMES.orchestrator_lease(2))  # lapsed, then taken by `live`
    await live.take(2)
    replacement = Leases(redis, NAMES, TTL_S, token="new")
    assert await replacement.release_dead("dead") == [0]
    assert await redis.get(NAMES.orchestrator_lease(0)) is None
    assert [await redis.get(NAMES.orchestrator_lease(s)) for s in (1, 2)] == [b"live"] * 2
    notices: Any = await redis.xrange(NAMES.orchestrator_released)
    assert [fields[b"slot"] for _id, fields in notices] == [b"0"]
    assert await replacement.take_lowest_free() == 0
