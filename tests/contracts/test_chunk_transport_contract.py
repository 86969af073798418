"""The ChunkTransport contract, over memory, polling (a SPEC connector lifted), Redis on
fakeredis and Redis on a real redis-server; then what only the Redis transport promises."""

from __future__ import annotations

import threading
import time

import pytest

from omni_runtime import keys
from omni_runtime.chunks import MemoryConnector, PollingTransport, RedisConnector
from omni_runtime.chunks.transport import ChunkRejected, ChunkTransport, Connector
from omni_runtime.core.types import MalformedChunk
from omni_runtime.keys import stored_chunk_key
from tests.contracts.chunk_worlds import PREFIX, World, redis_world, world

__all__ = ["redis_world", "world"]

pytestmark = pytest.mark.timeout(60)


def chunk(data: object, finished: bool = False) -> dict[str, object]:
    return {"data": data, "finished": finished}


class BareConnector:
    def put(self, key: str, obj: object) -> None: ...

    def get(self, key: str) -> object | None: ...


def test_every_transport_is_declared_and_a_bare_connector_is_not(world: World) -> None:
    t = world.transport().inner
    assert isinstance(t, ChunkTransport)
    assert t.max_batch >= 1
    assert isinstance(BareConnector(), Connector)
    assert not isinstance(BareConnector(), ChunkTransport)


def test_put_batch_then_fetch_is_aligned_and_consumes(world: World) -> None:
    t = world.transport().inner
    t.put_batch([("r_0_0", chunk("a"), False), ("r_0_2", chunk("c", True), True)])
    assert t.fetch(["r_0_0", "r_0_1", "r_0_2"]) == [chunk("a"), None, chunk("c", True)]
    assert t.fetch(["r_0_0", "r_0_1", "r_0_2"]) == [None, None, None]
    assert t.fetch([]) == []


def test_discard_deletes_what_exists_and_counts_it(world: World) -> None:
    t = world.transport().inner
    t.put_batch([("d_0_0", chunk(0), False)])
    t.put_batch([("keep_0_0", chunk(1), False)])
    assert t.discard(["d_0_0", "absent_0_0"]) == 1
    assert t.discard([]) == 0
    assert t.fetch(["d_0_0", "keep_0_0"]) == [None, chunk(1)]


def test_a_subscribed_put_ends_the_wait_with_its_route(world: World) -> None:
    receiver, sender = world.transport().inner, world.transport().inner
    receiver.subscribe([keys.route_id("req", 0)])
    sender.put_batch([("req_0_0", chunk("x"), False), ("other_0_0", chunk("y"), False)])
    sender.put_batch([("req_0_1", chunk("z"), False)])
    got: dict[str, int] = {}
    end = time.monotonic() + 10
    while receiver.signals_puts and got.get("req_0") != 1 and time.monotonic() < end:
        got.update(receiver.wait_for_puts(0.05))
    if receiver.signals_puts:
        assert got == {"req_0": 1}  # only subscribed routes, with the highest id put
    assert receiver.fetch(["req_0_0", "req_0_1"]) == [chunk("x"), chunk("z")]
    receiver.unsubscribe(["req_0"])


def test_wait_for_puts_times_out_empty_and_wake_ends_it_early(world: World) -> None:
    t = world.transport().inner
    t.subscribe(["quiet_0"])
    t0 = time.monotonic()
    assert t.wait_for_puts(0.05) == {}
    assert time.monotonic() - t0 >= 0.04
    threading.Timer(0.05, t.wake).start()
    t0 = time.monotonic()
    assert t.wait_for_puts(10.0) == {}
    assert time.monotonic() - t0 < 5.0


def test_polling_lifts_any_spec_connector() -> None:
    conn = MemoryConnector()
    t = PollingTransport(conn)
    assert t.max_batch == 1 and not t.signals_puts
    t.put_batch([("p_0_0", chunk(1), False)])
    assert conn.puts == ["p_0_0"]
    assert t.fetch(["p_0_0"]) == [chunk(1)] and len(conn) == 0


# --- Redis only ------------------------------------------------------------------------


def test_redis_put_batch_rejects_what_cannot_be_stored_and_stores_nothing(
    redis_world: World,
) -> None:
    w = redis_world
    t = w.transport().inner
    assert isinstance(t, RedisConnector)
    t.max_bytes = 100
    with pytest.raises(ChunkRejected) as info:
        t.put_batch(
            [
                ("ok_0_0", chunk("fine"), False),
                ("big_0_0", chunk(b"\0" * 200), False),
                ("set_0_0", chunk({1}), True),
            ]
        )
    assert sorted(info.value.rejected) == ["big_0_0", "set_0_0"]
    assert w.left() == 0


def test_redis_fetch_of_a_malformed_value_keeps_the_good_ones(redis_world: World) -> None:
    w = redis_world
    t = w.transport().inner
    t.put_batch([("m_0_0", chunk("good"), False)])
    w.put_garbage("m_0_1")
    got = t.fetch(["m_0_0", "m_0_1", "m_0_2"])
    assert got[0] == chunk("good") and got[2] is None
    assert isinstance(got[1], MalformedChunk) and got[1].key == stored_chunk_key("m_0_1", PREFIX)
    assert w.left() == 0  # consumed, not served twice


def test_redis_a_small_chunk_rides_in_its_wakeup(redis_world: World) -> None:
    w = redis_world
    receiver, sender = w.transport().inner, w.transport().inner
    receiver.subscribe(["inl_0"])
    sender.put_batch([("inl_0_0", chunk(b"small", True), True)])
    end = time.monotonic() + 10
    while not receiver.wait_for_puts(0.05) and time.monotonic() < end:
        pass
    w.raw.delete(stored_chunk_key("inl_0_0", PREFIX))  # proves the value came with the wake-up
    assert receiver.fetch(["inl_0_0"]) == [chunk(b"small", True)]


def test_redis_one_batch_for_many_routes_wakes_each_receiver_with_its_own_chunks(
    redis_world: World,
) -> None:
    """Wake-ups go out grouped by notify list: each receiver hears its routes only, with
    their values inline and in put order, on the first put (routes looked up) and later
    ones (routes cached)."""
    w = redis_world
    left, right, sender = w.transport().inner, w.transport().inner, w.transport().inner
    mine = {left: ["a_0", "b_0"], right: ["c_0", "d_0"]}
    for receiver, routes in mine.items():
        receiver.subscribe(routes)
    for first in (0, 2):  # two puts per route in each batch, the routes interleaved
        items = [(f"{r}_{first + i}", chunk(f"{r}_{first + i}"), False)
                 for i in range(2) for r in ("a_0", "c_0", "b_0", "d_0")]  # fmt: skip
        sender.put_batch(items)
        for receiver, routes in mine.items():
            got: dict[str, int] = {}
            end = time.monotonic() + 10
            while len(got) < 2 and time.monotonic() < end:
                got.update(receiver.wait_for_puts(0.05))
            assert got == {r: first + 1 for r in routes}
            ids = [f"{r}_{first + i}" for r in routes for i in range(2)]
            w.raw.delete(*(stored_chunk_key(k, PREFIX) for k in ids))  # inline, not read
            assert receiver.fetch(ids) == [chunk(k) for k in ids]
    for receiver, routes in mine.items():
        receiver.unsubscribe(routes)


def test_redis_unsubscribe_drops_the_route_and_unlistened_puts_leave_no_state(
    redis_world: World,
) -> None:
    w = redis_world
    receiver, sender = w.transport().inner, w.transport().inner
    receiver.subscribe(["u_0"])
    assert w.raw.exists(keys.chunk_route_key("u_0", PREFIX))
    receiver.unsubscribe(["u_0"])
    assert not w.raw.exists(keys.chunk_route_key("u_0", PREFIX))
    sender.put_batch([("solo_0_0", chunk("x", True), True)])
    assert sorted(k.decode() if isinstance(k, bytes) else k for k in w.raw.scan_iter("*")) == [
        f"{PREFIX}{{solo}}_0_0"
    ]
