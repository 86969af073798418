"""ChunkAdapter.discard (an aborted request at one stage), one test per rule, over every transport."""

from __future__ import annotations

import time
from typing import Any

import pytest

from omni_runtime import ChunkAdapter
from tests.contracts.chunk_worlds import World, world
from tests.fakes import Gate
from tests.waiting import wait_until

__all__ = ["world"]

pytestmark = pytest.mark.timeout(60)


def count(adapter: ChunkAdapter, name: str) -> float:
    return adapter.metrics.value(f"omni_{name}_total")


def save_barrier(snd: ChunkAdapter, world: World, name: str) -> None:
    """Everything queued on the SAVE thread before this has been handled (one FIFO)."""
    snd.save_async(name, "barrier", True)
    wait_until(lambda: f"{name}_{snd.stage_id}_0" in world.puts)


def assert_contiguous(keys: list[str], prefix: str) -> None:
    assert keys == [f"{prefix}{i}" for i in range(len(keys))]


# --- sender --------------------------------------------------------------------


def test_discard_mid_stream_drops_queued_sends_a_none_final_and_deletes_every_key(
    world: World,
) -> None:
    gate = Gate("p2")
    snd, _t = world.adapter(0, build_payload=gate)
    try:
        snd.save_async("r", "p0", False)
        snd.save_async("r", "p1", False)
        wait_until(lambda: len(world.put_keys("r_")) == 2)
        snd.save_async("r", "p2", False)  # being built when the discard comes
        assert gate.entered.wait(10)
        snd.save_async("r", "p3", False)  # queued behind it
        snd.save_async("r", "p4", False)
        t0 = time.monotonic()
        snd.discard("r")
        assert time.monotonic() - t0 < 0.5  # scheduler-thread API: returns at once
    finally:
        gate.release.set()
    wait_until(lambda: any(v["finished"] for v in world.put_values("r_")))
    save_barrier(snd, world, "z")
    assert_contiguous(world.put_keys("r_"), "r_0_")
    assert world.put_values("r_") == [
        {"data": "p0", "finished": False},
        {"data": "p1", "finished": False},
        {"data": "p2", "finished": False},  # had passed the cancel check
        {"data": None, "finished": True},
    ]
    assert count(snd, "chunks_dropped") == 2
    assert world.present("r_0_") == []  # every key it wrote is gone
    assert world.present("z_0_") == ["z_0_0"]  # other requests untouched


def test_discard_mid_stream_when_idle_sends_the_final_at_the_next_id(world: World) -> None:
    snd, _t = world.adapter(1)
    snd.save_async("r", "a", False)
    snd.save_async("r", "b", False)
    wait_until(lambda: len(world.put_keys("r_")) == 2)
    snd.discard("r")
    save_barrier(snd, world, "z")
    assert world.put_keys("r_") == ["r_1_0", "r_1_1", "r_1_2"]
    assert world.put_values("r_")[-1] == {"data": None, "finished": True}
    assert world.present("r_1_") == []


def test_discard_after_the_sender_finished_sends_nothing_and_deletes_nothing_else(
    world: World,
) -> None:
    snd, _t = world.adapter(0)
    snd.save_async("r", "a", False)
    snd.save_async("r", "b", True)
    snd.save_async("other", "o0", False)  # another request, mid-stream
    wait_until(lambda: len(world.puts) == 3)
    snd.discard("r")
    save_barrier(snd, world, "z")
    assert world.put_keys("r_") == ["r_0_0", "r_0_1"]  # no extra final
    assert world.present("other_0_") == ["other_0_0"]
    snd.save_async("other", "o1", True)  # its stream goes on at the next id
    wait_until(lambda: len(world.put_keys("other_")) == 2)
    assert world.put_keys("other_") == ["other_0_0", "other_0_1"]
    assert count(snd, "chunks_dropped") == 0


def test_discard_while_the_senders_own_final_is_still_queued_sends_one_final(
    world: World,
) -> None:
    gate = Gate("hold")
    snd, _t = world.adapter(0, build_payload=gate)
    try:
        snd.save_async("r", "a", False)
        wait_until(lambda: world.put_keys("r_") == ["r_0_0"])
        snd.save_async("x", "hold", True)  # holds the SAVE thread: r's items queue up
        assert gate.entered.wait(10)
        snd.save_async("r", "b", False)
        snd.save_async("r", "end", True)
        snd.discard("r")
    finally:
        gate.release.set()
    save_barrier(snd, world, "z")  # every put and delete for r is done by now
    finals = [v for v in world.put_values("r_") if v["finished"]]
    assert len(finals) == 1, world.log
    assert_contiguous(world.put_keys("r_"), "r_0_")
    assert world.put_values("r_")[-1]["finished"]
    assert world.present("r_0_") == []


def test_discard_clears_a_cancel_mark_of_a_request_with_nothing_saved(world: World) -> None:
    snd, _t = world.adapter(0)
    snd.cancel_sender("r")
    snd.discard("r")
    snd.save_async("r", "kept", True)  # the mark is gone: sent as built
    save_barrier(snd, world, "z")
    assert world.put_values("r_") == [{"data": "kept", "finished": True}]


# --- receiver ------------------------------------------------------------------


def test_discard_stops_receiving_and_deletes_unread_chunks_now_and_later(world: World) -> None:
    rcv, t = world.adapter(1)
    rcv.load_async("r")
    world.put("r_0_0", {"data": 0, "finished": False})
    wait_until(lambda: count(rcv, "chunks_received") == 1)  # received, not yet polled
    t.hold_key = "r_0_1"
    try:
        world.put("r_0_1", {"data": 1, "finished": False})  # its read is held
        assert t.in_fetch.wait(10)
        world.put("r_0_2", {"data": 2, "finished": False})
        world.put("r_0_3", {"data": 3, "finished": False})
        assert rcv.pending_receives() == 1
        t0 = time.monotonic()
        rcv.discard("r")
        assert time.monotonic() - t0 < 0.5  # scheduler-thread API: returns at once
        assert rcv.pending_receives() == 0
        assert "r" not in rcv.poll_ready()  # the received, unpolled chunk is dropped too
    finally:
        t.release.set()
    wait_until(lambda: world.present("r_0_") == [])
    # a chunk its upstream put while the abort was under way: the late sweep gets it
    world.put("r_0_4", {"data": 4, "finished": False})
    wait_until(lambda: world.present("r_0_") == [], deadline_s=10)
    assert rcv.poll_ready() == {}
    assert count(rcv, "chunks_received") == 1


def test_discard_of_a_receiver_leaves_other_requests_receiving(world: World) -> None:
    snd, _t = world.adapter(0)
    rcv, _t = world.adapter(1)
    rcv.load_async("r")
    rcv.load_async("keep")
    snd.save_async("keep", "k0", False)
    wait_until(lambda: count(rcv, "chunks_received") == 1)
    rcv.discard("r")
    snd.save_async("keep", "k1", True)
    got: list[Any] = []

    def keep_done() -> bool:
        got.extend(c["data"] for c in rcv.poll_ready().get("keep", []))
        return len(got) == 2

    wait_until(keep_done)
    assert got == ["k0", "k1"]
    wait_until(lambda: rcv.pending_receives() == 0)


def test_discard_of_an_unknown_request_is_harmless(world: World) -> None:
    snd, _t = world.adapter(0)
    rcv, _t = world.adapter(1)
    rcv.load_async("live")
    snd.save_async("live", "a", False)
    wait_until(lambda: count(rcv, "chunks_received") == 1)
    snd.discard("ghost")
    rcv.discard("ghost")
    snd.save_async("live", "b", True)
    got: list[Any] = []

    def live_done() -> bool:
        got.extend(c["data"] for c in rcv.poll_ready().get("live", []))
        return len(got) == 2

    wait_until(live_done)
    save_barrier(snd, world, "z")
    assert got == ["a", "b"]
    assert world.put_keys("ghost_") == []
    assert count(snd, "chunks_dropped") == 0 and count(snd, "chunk_put_failures") == 0
    assert rcv.pending_receives() == 0
