"""SPEC §4: the ChunkAdapter's seed examples and one test per rule, over every transport."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from omni_runtime import ChunkAdapter
from tests.contracts.chunk_worlds import World, world
from tests.fakes import Gate
from tests.waiting import wait_until

__all__ = ["world"]

pytestmark = pytest.mark.timeout(60)

Chunk = dict[str, Any]


def count(adapter: ChunkAdapter, name: str) -> float:
    return adapter.metrics.value(f"omni_{name}_total")


def drain(rcv: ChunkAdapter, rid: str, n: int) -> list[Chunk]:
    """Poll until `n` chunks of `rid` arrived (deadline-bounded)."""
    got: list[Chunk] = []

    def more() -> bool:
        got.extend(rcv.poll_ready().get(rid, []))
        return len(got) >= n

    wait_until(more)
    return got


def pair(world: World, **snd_kw: Any) -> tuple[ChunkAdapter, ChunkAdapter]:
    return world.adapter(0, **snd_kw)[0], world.adapter(1)[0]


# --- seed examples -------------------------------------------------------------


def test_seed_snapshot_isolation(world: World) -> None:
    snd, rcv = pair(world)
    live = ["a"]
    rcv.load_async("v")
    snd.save_async("v", live, is_final=False)
    live.append("b")
    snd.save_async("v", live, is_final=True)
    live.append("c")
    got = drain(rcv, "v", 2)
    assert [c["data"] for c in got] == [["a"], ["a", "b"]]
    assert world.puts == ["v_0_0", "v_0_1"]


def test_seed_poll_ready_takes_what_is_new(world: World) -> None:
    snd, rcv = pair(world)
    rcv.load_async("q")
    snd.save_async("q", 1, False)
    snd.save_async("q", 2, False)
    wait_until(lambda: count(rcv, "chunks_received") == 2)
    assert rcv.poll_ready() == {
        "q": [{"data": 1, "finished": False}, {"data": 2, "finished": False}]
    }
    assert rcv.poll_ready() == {}
    snd.save_async("q", 3, True)
    wait_until(lambda: count(rcv, "chunks_received") == 3)
    assert rcv.poll_ready() == {"q": [{"data": 3, "finished": True}]}


def test_seed_cancel_while_building(world: World) -> None:
    gate = Gate("p0")
    snd, rcv = pair(world, build_payload=gate)
    try:
        rcv.load_async("w")
        snd.save_async("w", "p0", False)
        assert gate.entered.wait(10)
        for p in ("p1", "p2", "p3"):
            snd.save_async("w", p, False)
        snd.save_async("w", "end", True)
        snd.cancel_sender("w")
    finally:
        gate.release.set()
    wait_until(lambda: rcv.pending_receives() == 0)
    assert rcv.poll_ready()["w"] == [
        {"data": "p0", "finished": False},
        {"data": None, "finished": True},
    ]
    assert world.puts == ["w_0_0", "w_0_1"]
    assert count(snd, "chunks_dropped") == 3


def test_cancel_before_building_delivers_only_the_final_as_id_0(world: World) -> None:
    gate = Gate("x0")  # blocks another request, so w's items wait in the FIFO
    snd, rcv = pair(world, build_payload=gate)
    try:
        snd.save_async("x", "x0", False)
        assert gate.entered.wait(10)
        snd.save_async("w", "p0", False)
        snd.save_async("w", "end", True)
        snd.cancel_sender("w")
    finally:
        gate.release.set()
    rcv.load_async("w")
    assert drain(rcv, "w", 1) == [{"data": None, "finished": True}]
    assert world.put_keys("w_") == ["w_0_0"]


def test_cancel_before_the_first_save_marks_the_request(world: World) -> None:
    snd, rcv = pair(world)
    snd.cancel_sender("early")  # nothing saved yet: the mark must hold anyway
    snd.save_async("early", "p0", False)
    snd.save_async("early", "p1", False)
    snd.save_async("early", "end", True)
    rcv.load_async("early")
    assert drain(rcv, "early", 1) == [{"data": None, "finished": True}]
    assert world.put_keys("early_") == ["early_0_0"]
    assert count(snd, "chunks_dropped") == 2
    snd.save_async("early", "again", True)  # the final put cleared the mark: put whole
    # Seen in what was put, not read back: the same id's key again, read by the receiver
    # that served the first final inline, can lose to that final's deferred unlink.
    wait_until(lambda: len(world.put_values("early_")) == 2)
    assert world.put_values("early_")[-1] == {"data": "again", "finished": True}


# --- sender rules --------------------------------------------------------------


def test_snapshot_isolates_nested_containers(world: World) -> None:
    snd, rcv = pair(world)
    live: dict[str, Any] = {"tokens": [1, 2], "meta": {"k": [0]}}
    rcv.load_async("n")
    snd.save_async("n", live, is_final=True)
    live["tokens"].append(3)
    live["meta"]["k"].append(1)
    live["new"] = True
    assert drain(rcv, "n", 1) == [
        {"data": {"tokens": [1, 2], "meta": {"k": [0]}}, "finished": True}
    ]


def test_build_payload_none_skipped_unless_final(world: World) -> None:
    snd, rcv = pair(world, build_payload=lambda s: None if s == "skip" else s)
    rcv.load_async("r")
    for data, final in (("a", False), ("skip", False), ("b", False), ("skip", True)):
        snd.save_async("r", data, final)
    assert drain(rcv, "r", 3) == [
        {"data": "a", "finished": False},
        {"data": "b", "finished": False},
        {"data": None, "finished": True},
    ]
    assert world.puts == ["r_0_0", "r_0_1", "r_0_2"]


def test_save_async_never_calls_build_and_returns_at_once(world: World) -> None:
    gate = Gate("block")
    snd, _rcv = pair(world, build_payload=gate)
    try:
        snd.save_async("r", "block", False)
        assert gate.entered.wait(10)
        t0 = time.perf_counter()
        for i in range(1000):
            snd.save_async("r", i, False)
        # Not a benchmark: a generous bound that only a blocking call would exceed.
        assert (time.perf_counter() - t0) / 1000 < 0.005
        assert world.puts == []
    finally:
        gate.release.set()
    wait_until(lambda: len(world.puts) == 1001)


def test_ids_restart_at_0_after_a_final(world: World) -> None:
    snd, _t = world.adapter(3)
    snd.save_async("r", "a", True)
    wait_until(lambda: len(world.puts) == 1)
    snd.save_async("r", "b", True)
    wait_until(lambda: len(world.puts) == 2)
    assert world.puts == ["r_3_0", "r_3_0"]


# --- receiver rules ------------------------------------------------------------


def test_chunks_put_before_load_async_are_received(world: World) -> None:
    snd, rcv = pair(world)
    snd.save_async("early", "x", False)
    snd.save_async("early", "y", True)
    wait_until(lambda: len(world.puts) == 2)
    rcv.load_async("early")
    assert [c["data"] for c in drain(rcv, "early", 2)] == ["x", "y"]


def test_load_async_is_idempotent_while_registered(world: World) -> None:
    snd, rcv = pair(world)
    rcv.load_async("r")
    snd.save_async("r", "a", False)
    assert [c["data"] for c in drain(rcv, "r", 1)] == ["a"]
    rcv.load_async("r")  # must not reset the next id to 0
    snd.save_async("r", "b", True)
    assert [c["data"] for c in drain(rcv, "r", 1)] == ["b"]


def test_src_stage_id_reads_the_senders_keys(world: World) -> None:
    snd, _t = world.adapter(0)
    rcv, _t = world.adapter(5, src_stage_id=0)
    rcv.load_async("r")
    snd.save_async("r", "a", True)
    assert drain(rcv, "r", 1) == [{"data": "a", "finished": True}]


def test_on_ready_wakes_a_scheduler_that_then_finds_every_chunk(world: World) -> None:
    """A scheduler sleeps until `on_ready` (a worker's does): each wake finds what it was
    woken for, and no chunk is left unannounced, the last one included."""
    woken = threading.Semaphore(0)
    snd = world.adapter(0)[0]
    rcv = world.adapter(1, on_ready=woken.release)[0]
    rcv.load_async("r")
    got: list[Chunk] = []
    for i in range(5):
        snd.save_async("r", i, is_final=i == 4)
        while len(got) <= i:  # only ever after a wake: a chunk with none would hang here
            assert woken.acquire(timeout=10), f"no wake-up for chunk {i} (got {got})"
            got += rcv.poll_ready().get("r", [])
    assert [c["data"] for c in got] == [0, 1, 2, 3, 4]


def test_finished_chunk_unregisters_the_request(world: World) -> None:
    snd, rcv = pair(world)
    rcv.load_async("r")
    snd.save_async("r", "a", True)
    drain(rcv, "r", 1)
    wait_until(lambda: rcv.pending_receives() == 0)


def test_cleanup_receiver_is_a_barrier_against_an_in_flight_get(world: World) -> None:
    rcv, t = world.adapter(1)
    t.hold_key = "r_0_0"
    try:
        world.put("r_0_0", {"data": "stale", "finished": False})
        rcv.load_async("r")
        assert t.in_fetch.wait(10)  # read, and held before its commit
        rcv.cleanup_receiver("r")
        rcv.load_async("r")  # registered again with a fresh token
        world.put("r_0_0", {"data": "fresh", "finished": True})  # before the stale read returns
    finally:
        t.release.set()
    wait_until(lambda: rcv.pending_receives() == 0)
    assert rcv.poll_ready() == {"r": [{"data": "fresh", "finished": True}]}


def test_cleanup_receiver_drops_ready_chunks(world: World) -> None:
    snd, rcv = pair(world)
    rcv.load_async("r")
    snd.save_async("r", "a", False)
    wait_until(lambda: count(rcv, "chunks_received") == 1)
    rcv.cleanup_receiver("r")
    assert rcv.poll_ready() == {}
    assert rcv.pending_receives() == 0


def test_failing_get_does_not_kill_the_recv_thread(world: World) -> None:
    rcv, t = world.adapter(1)
    t.fail_fetches = 3
    world.put("r_0_0", {"data": "a", "finished": True})
    rcv.load_async("r")
    assert drain(rcv, "r", 1) == [{"data": "a", "finished": True}]
    assert count(rcv, "chunk_get_failures") == 3


def test_malformed_chunk_is_counted_and_skipped(world: World) -> None:
    rcv, _t = world.adapter(1)
    world.put_garbage("r_0_0")
    world.put("r_0_1", {"data": "ok", "finished": True})
    rcv.load_async("r")
    assert drain(rcv, "r", 1) == [{"data": "ok", "finished": True}]
    assert count(rcv, "malformed_chunks") == 1


def test_many_requests_keep_order_and_contiguous_ids_and_leave_nothing(world: World) -> None:
    snd, rcv = pair(world)
    n_req, n_chunks = 30, 15
    for r in range(0, n_req, 2):  # half registered before their chunks, half after
        rcv.load_async(f"r{r}")
    for i in range(n_chunks):
        for r in range(n_req):
            snd.save_async(f"r{r}", {"i": i, "blob": bytes(64)}, i == n_chunks - 1)
    for r in range(1, n_req, 2):
        rcv.load_async(f"r{r}")
    got: dict[str, list[int]] = {}

    def all_in() -> bool:
        for rid, chunks in rcv.poll_ready().items():
            got.setdefault(rid, []).extend(c["data"]["i"] for c in chunks)
        return rcv.pending_receives() == 0

    wait_until(all_in, deadline_s=30)
    all_in()
    assert got == {f"r{r}": list(range(n_chunks)) for r in range(n_req)}
    wait_until(lambda: world.left() == 0)  # every chunk consumed (and deleted)


def test_stop_returns_promptly_while_idle(world: World) -> None:
    adapter, _t = world.adapter(1)
    adapter.load_async("idle")  # RECV thread waiting for puts, SAVE thread waiting
    wait_until(lambda: adapter.pending_receives() == 1)
    t0 = time.monotonic()
    adapter.stop()
    assert time.monotonic() - t0 < 1.0
    assert not adapter.is_alive()
