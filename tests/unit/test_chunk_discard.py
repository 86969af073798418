"""ChunkAdapter.discard (an aborted request at one stage) with the MemoryConnector:
one test per rule."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from omni_runtime import ChunkAdapter
from omni_runtime.chunks import MemoryConnector
from tests.fakes import Gate
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


class RecordingConnector(MemoryConnector):
    """Also records every value put (the store itself is consumed and purged), and can
    hold the next `peek_many` (the receiver's read) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[tuple[str, Any]] = []
        self.hold_next_read = threading.Event()
        self.in_read = threading.Event()
        self.release = threading.Event()

    def put(self, key: str, obj: Any) -> None:
        super().put(key, obj)
        self.values.append((key, obj))

    def put_many(self, items: Sequence[tuple[str, Any]]) -> None:
        super().put_many(items)
        self.values.extend(items)

    def peek_many(self, keys: Sequence[str], delete_first: Sequence[str] = ()) -> list[Any]:
        if self.hold_next_read.is_set():
            self.hold_next_read.clear()
            self.in_read.set()
            assert self.release.wait(10)
        return super().peek_many(keys, delete_first)

    def present(self, prefix: str, upto: int = 200) -> list[str]:
        """The keys `<prefix>0 .. <prefix>upto-1` stored now (without consuming or holding)."""
        candidates = [f"{prefix}{i}" for i in range(upto)]
        values = MemoryConnector.peek_many(self, candidates)
        return [k for k, v in zip(candidates, values, strict=True) if v is not None]

    def put_keys(self, prefix: str) -> list[str]:
        return [k for k in self.puts if k.startswith(prefix)]

    def put_values(self, prefix: str) -> list[Any]:
        return [v for k, v in self.values if k.startswith(prefix)]


def save_barrier(snd: ChunkAdapter, conn: RecordingConnector, name: str) -> None:
    """Everything queued on the SAVE thread before this has been handled (one FIFO)."""
    snd.save_async(name, "barrier", True)
    wait_until(lambda: f"{name}_{snd.stage_id}_0" in conn.puts)


def assert_contiguous(keys: list[str], prefix: str) -> None:
    assert keys == [f"{prefix}{i}" for i in range(len(keys))]


# --- sender --------------------------------------------------------------------


def test_discard_mid_stream_drops_queued_sends_a_none_final_and_deletes_every_key() -> None:
    conn = RecordingConnector()
    gate = Gate("p2")
    snd = ChunkAdapter(conn, stage_id=0, build_payload=gate)
    try:
        snd.save_async("r", "p0", False)
        snd.save_async("r", "p1", False)
        wait_until(lambda: len(conn.put_keys("r_")) == 2)
        snd.save_async("r", "p2", False)  # being built when the discard comes
        assert gate.entered.wait(10)
        snd.save_async("r", "p3", False)  # queued behind it
        snd.save_async("r", "p4", False)
        t0 = time.monotonic()
        snd.discard("r")
        assert time.monotonic() - t0 < 0.5  # scheduler-thread API: returns at once
        gate.release.set()
        wait_until(lambda: any(v["finished"] for v in conn.put_values("r_")))
        wait_until(lambda: conn.present("r_0_") == [])
        save_barrier(snd, conn, "z")
        keys = conn.put_keys("r_")
        assert_contiguous(keys, "r_0_")
        assert conn.put_values("r_") == [
            {"data": "p0", "finished": False},
            {"data": "p1", "finished": False},
            {"data": "p2", "finished": False},  # had passed the cancel check
            {"data": None, "finished": True},
        ]
        assert snd.dropped_chunks == 2
        assert conn.present("r_0_") == []  # every key it wrote is gone, none came back
        assert conn.present("z_0_") == ["z_0_0"]  # other requests untouched
    finally:
        gate.release.set()
        snd.stop()


def test_discard_mid_stream_when_idle_sends_the_final_at_the_next_id() -> None:
    conn = RecordingConnector()
    snd = ChunkAdapter(conn, stage_id=1)
    try:
        snd.save_async("r", "a", False)
        snd.save_async("r", "b", False)
        wait_until(lambda: len(conn.put_keys("r_")) == 2)
        snd.discard("r")
        wait_until(lambda: len(conn.put_keys("r_")) == 3)
        wait_until(lambda: conn.present("r_1_") == [])
        save_barrier(snd, conn, "z")
        assert conn.put_keys("r_") == ["r_1_0", "r_1_1", "r_1_2"]
        assert conn.put_values("r_")[-1] == {"data": None, "finished": True}
        assert conn.present("r_1_") == []
    finally:
        snd.stop()


def test_discard_after_the_sender_finished_sends_nothing_and_deletes_nothing_else() -> None:
    conn = RecordingConnector()
    snd = ChunkAdapter(conn, stage_id=0)
    try:
        snd.save_async("r", "a", False)
        snd.save_async("r", "b", True)
        snd.save_async("other", "o0", False)  # another request, mid-stream
        wait_until(lambda: len(conn.puts) == 3)
        snd.discard("r")
        save_barrier(snd, conn, "z")
        assert conn.put_keys("r_") == ["r_0_0", "r_0_1"]  # no extra final
        assert [v["finished"] for v in conn.put_values("r_")] == [False, True]
        assert conn.present("other_0_") == ["other_0_0"]
        snd.save_async("other", "o1", True)  # its stream goes on at the next id
        wait_until(lambda: len(conn.put_keys("other_")) == 2)
        assert conn.put_keys("other_") == ["other_0_0", "other_0_1"]
        assert conn.put_values("other_") == [
            {"data": "o0", "finished": False},
            {"data": "o1", "finished": True},
        ]
        assert snd.dropped_chunks == 0
    finally:
        snd.stop()


def test_discard_while_the_senders_own_final_is_still_queued_sends_one_final() -> None:
    """The stage already called save_async(final); the discard comes before the SAVE
    thread put it. Exactly one final may go out, ids contiguous, then every key deleted."""
    conn = RecordingConnector()
    gate = Gate("hold")
    snd = ChunkAdapter(conn, stage_id=0, build_payload=gate)
    try:
        snd.save_async("r", "a", False)
        wait_until(lambda: conn.put_keys("r_") == ["r_0_0"])
        snd.save_async("x", "hold", True)  # holds the SAVE thread: r's items queue up
        assert gate.entered.wait(10)
        snd.save_async("r", "b", False)
        snd.save_async("r", "end", True)
        snd.discard("r")
        gate.release.set()
        wait_until(lambda: any(v["finished"] for v in conn.put_values("r_")))
        save_barrier(snd, conn, "z")  # every put and delete for r is done by now
        finals = [v for v in conn.put_values("r_") if v["finished"]]
        assert len(finals) == 1, conn.values
        assert_contiguous(conn.put_keys("r_"), "r_0_")
        assert conn.put_values("r_")[-1]["finished"]
        assert conn.present("r_0_") == []
    finally:
        gate.release.set()
        snd.stop()


# --- receiver ------------------------------------------------------------------


def test_discard_stops_receiving_and_deletes_unread_chunks_now_and_later() -> None:
    conn = RecordingConnector()
    rcv = ChunkAdapter(conn, stage_id=1)
    try:
        rcv.load_async("r")
        conn.put("r_0_0", {"data": 0, "finished": False})
        wait_until(lambda: rcv.received_chunks == 1)  # received, not yet polled
        conn.hold_next_read.set()
        conn.put("r_0_1", {"data": 1, "finished": False})  # its read is held
        assert conn.in_read.wait(10)
        conn.put("r_0_2", {"data": 2, "finished": False})
        conn.put("r_0_3", {"data": 3, "finished": False})
        assert rcv.pending_receives() == 1
        t0 = time.monotonic()
        rcv.discard("r")
        assert time.monotonic() - t0 < 0.5  # scheduler-thread API: returns at once
        assert rcv.pending_receives() == 0
        assert "r" not in rcv.poll_ready()  # the received, unpolled chunk is dropped too
        conn.release.set()
        wait_until(lambda: conn.present("r_0_") == [])
        # a chunk its upstream put while the abort was under way: the late sweep gets it
        conn.put("r_0_4", {"data": 4, "finished": False})
        wait_until(lambda: conn.present("r_0_") == [], deadline_s=5.0)
        assert rcv.poll_ready() == {}
        assert rcv.received_chunks == 1
        assert rcv.pending_receives() == 0
        assert conn.put_keys("r_1_") == []  # a receiver only: it sends nothing
    finally:
        conn.release.set()
        rcv.stop()


def test_discard_of_a_receiver_leaves_other_requests_receiving() -> None:
    conn = RecordingConnector()
    snd = ChunkAdapter(conn, stage_id=0)
    rcv = ChunkAdapter(conn, stage_id=1)
    try:
        rcv.load_async("r")
        rcv.load_async("keep")
        snd.save_async("keep", "k0", False)
        wait_until(lambda: rcv.received_chunks == 1)
        rcv.discard("r")
        snd.save_async("keep", "k1", True)
        got: list[Any] = []

        def keep_done() -> bool:
            got.extend(c["data"] for c in rcv.poll_ready().get("keep", []))
            return len(got) == 2

        wait_until(keep_done)
        assert got == ["k0", "k1"]
        wait_until(lambda: rcv.pending_receives() == 0)
    finally:
        snd.stop()
        rcv.stop()


# --- unknown request -----------------------------------------------------------


def test_discard_of_an_unknown_request_is_harmless() -> None:
    conn = RecordingConnector()
    snd = ChunkAdapter(conn, stage_id=0)
    rcv = ChunkAdapter(conn, stage_id=1)
    try:
        rcv.load_async("live")
        snd.save_async("live", "a", False)
        wait_until(lambda: rcv.received_chunks == 1)
        snd.discard("ghost")
        rcv.discard("ghost")
        snd.save_async("live", "b", True)
        got: list[Any] = []

        def live_done() -> bool:
            got.extend(c["data"] for c in rcv.poll_ready().get("live", []))
            return len(got) == 2

        wait_until(live_done)
        save_barrier(snd, conn, "z")
        assert got == ["a", "b"]
        assert conn.put_keys("live_") == ["live_0_0", "live_0_1"]
        assert conn.put_keys("ghost_") == []
        assert snd.dropped_chunks == 0 and snd.failed_puts == 0
        assert rcv.pending_receives() == 0
    finally:
        snd.stop()
        rcv.stop()


def test_discard_on_a_connector_that_cannot_delete_leaves_the_receiver_idle() -> None:
    """No peek/delete: nothing to sweep, and no sweep left due to spin the RECV thread."""
    from tests.unit.test_chunk_adapter import PlainConnector

    rcv = ChunkAdapter(PlainConnector(), stage_id=1)
    try:
        rcv.load_async("r")
        rcv.discard("r")
        assert rcv._receiver._sweeper.next_due() is None
    finally:
        rcv.stop()
