"""SPEC §4: the ChunkAdapter's seed examples and one test per rule."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from omni_runtime import ChunkAdapter
from omni_runtime.chunks import MemoryConnector
from tests.fakes import Gate
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)

Chunk = dict[str, Any]


def drain(rcv: ChunkAdapter, rid: str, n: int) -> list[Chunk]:
    """Poll until `n` chunks of `rid` arrived (deadline-bounded)."""
    got: list[Chunk] = []

    def more() -> bool:
        got.extend(rcv.poll_ready().get(rid, []))
        return len(got) >= n

    wait_until(more)
    return got


class PlainConnector:
    """Only the duck-typed minimum of SPEC §2 (put, consuming get): the polling fallback path."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: dict[str, Any] = {}
        self.puts: list[str] = []

    def put(self, key: str, obj: Any) -> None:
        with self._lock:
            self._store[key] = obj
            self.puts.append(key)

    def get(self, key: str) -> Any | None:
        with self._lock:
            return self._store.pop(key, None)

    def __len__(self) -> int:
        return len(self._store)


@pytest.fixture(params=["memory", "plain"])
def conn(request: pytest.FixtureRequest) -> Any:
    """Every rule holds with wake-ups and look-ahead (memory) and with bare polling (plain)."""
    return MemoryConnector() if request.param == "memory" else PlainConnector()


@pytest.fixture
def pair(conn: MemoryConnector) -> Iterator[tuple[ChunkAdapter, ChunkAdapter]]:
    snd = ChunkAdapter(conn, stage_id=0)
    rcv = ChunkAdapter(conn, stage_id=1)
    yield snd, rcv
    snd.stop()
    rcv.stop()


# --- seed examples -------------------------------------------------------------


def test_seed_snapshot_isolation(pair: tuple[ChunkAdapter, ChunkAdapter], conn: Any) -> None:
    snd, rcv = pair
    live = ["a"]
    rcv.load_async("v")
    snd.save_async("v", live, is_final=False)
    live.append("b")
    snd.save_async("v", live, is_final=True)
    live.append("c")
    got = drain(rcv, "v", 2)
    assert [c["data"] for c in got] == [["a"], ["a", "b"]]
    assert conn.puts == ["v_0_0", "v_0_1"]


def test_seed_poll_ready_takes_what_is_new(pair: tuple[ChunkAdapter, ChunkAdapter]) -> None:
    snd, rcv = pair
    rcv.load_async("q")
    snd.save_async("q", 1, False)
    snd.save_async("q", 2, False)
    wait_until(lambda: rcv.received_chunks == 2)
    assert rcv.poll_ready() == {
        "q": [{"data": 1, "finished": False}, {"data": 2, "finished": False}]
    }
    assert rcv.poll_ready() == {}
    snd.save_async("q", 3, True)
    wait_until(lambda: rcv.received_chunks == 3)
    assert rcv.poll_ready() == {"q": [{"data": 3, "finished": True}]}


def test_seed_cancel_while_building(conn: MemoryConnector) -> None:
    gate = Gate("p0")
    snd = ChunkAdapter(conn, stage_id=0, build_payload=gate)
    rcv = ChunkAdapter(conn, stage_id=1)
    try:
        rcv.load_async("w")
        snd.save_async("w", "p0", False)
        assert gate.entered.wait(10)
        for p in ("p1", "p2", "p3"):
            snd.save_async("w", p, False)
        snd.save_async("w", "end", True)
        snd.cancel_sender("w")
        gate.release.set()
        wait_until(lambda: rcv.pending_receives() == 0)
        got = rcv.poll_ready()["w"]
        assert got == [{"data": "p0", "finished": False}, {"data": None, "finished": True}]
        assert conn.puts == ["w_0_0", "w_0_1"]
        assert snd.dropped_chunks == 3
    finally:
        snd.stop()
        rcv.stop()


def test_cancel_before_building_delivers_only_the_final_as_id_0(conn: MemoryConnector) -> None:
    gate = Gate("x0")  # blocks another request, so w's items wait in the FIFO
    snd = ChunkAdapter(conn, stage_id=0, build_payload=gate)
    try:
        snd.save_async("x", "x0", False)
        assert gate.entered.wait(10)
        snd.save_async("w", "p0", False)
        snd.save_async("w", "end", True)
        snd.cancel_sender("w")
        gate.release.set()
        wait_until(lambda: "w_0_0" in conn.puts)
        assert [k for k in conn.puts if k.startswith("w_")] == ["w_0_0"]
        assert conn.get("w_0_0") == {"data": None, "finished": True}
    finally:
        snd.stop()


# --- sender rules --------------------------------------------------------------


def test_snapshot_isolates_nested_containers(pair: tuple[ChunkAdapter, ChunkAdapter]) -> None:
    snd, rcv = pair
    live: dict[str, Any] = {"tokens": [1, 2], "meta": {"k": [0]}}
    rcv.load_async("n")
    snd.save_async("n", live, is_final=True)
    live["tokens"].append(3)
    live["meta"]["k"].append(1)
    live["new"] = True
    assert drain(rcv, "n", 1) == [
        {"data": {"tokens": [1, 2], "meta": {"k": [0]}}, "finished": True}
    ]


class FlakyConnector(PlainConnector):
    """Raises on the puts whose 0-based call number is in `fail_calls`."""

    def __init__(self, fail_calls: set[int]) -> None:
        super().__init__()
        self.fail_calls = fail_calls
        self.calls = 0

    def put(self, key: str, obj: Any) -> None:
        n, self.calls = self.calls, self.calls + 1
        if n in self.fail_calls:
            raise OSError("redis went away")
        super().put(key, obj)


class FlakyBatchConnector(MemoryConnector):
    """`put_many` (all or nothing) fails on its first call; single puts succeed."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str]] = []

    def put_many(self, items: Any) -> None:
        self.batches.append([k for k, _o in items])
        if len(self.batches) == 1:
            raise OSError("redis went away")
        super().put_many(items)


def test_a_failed_batch_advances_no_id() -> None:
    conn = FlakyBatchConnector()
    gate = Gate("hold")
    snd = ChunkAdapter(conn, stage_id=0, build_payload=gate)
    try:
        snd.save_async("x", "hold", True)  # holds the SAVE thread so the next ones queue up
        assert gate.entered.wait(10)
        for i in range(3):
            snd.save_async("r", i, False)
        gate.release.set()
        wait_until(lambda: snd.failed_puts == 4)
        assert conn.batches == [["x_0_0", "r_0_0", "r_0_1", "r_0_2"]]
        snd.save_async("r", "again", True)
        wait_until(lambda: conn.puts == ["r_0_0"])  # id 0 again: the batch advanced nothing
    finally:
        gate.release.set()
        snd.stop()


def test_id_advances_only_on_successful_put() -> None:
    conn = FlakyConnector(fail_calls={1})
    snd = ChunkAdapter(conn, stage_id=0)
    try:
        for i, final in ((0, False), (1, False), (2, False), (3, True)):
            snd.save_async("r", i, final)
        wait_until(lambda: conn.calls == 4)
        wait_until(lambda: snd.failed_puts == 1 and snd.sent_chunks == 3)
        assert conn.puts == ["r_0_0", "r_0_1", "r_0_2"]
        assert [conn.get(k)["data"] for k in conn.puts] == [0, 2, 3]
    finally:
        snd.stop()


def test_build_payload_none_skipped_unless_final(conn: MemoryConnector) -> None:
    snd = ChunkAdapter(conn, stage_id=0, build_payload=lambda s: None if s == "skip" else s)
    try:
        snd.save_async("r", "a", False)
        snd.save_async("r", "skip", False)
        snd.save_async("r", "b", False)
        snd.save_async("r", "skip", True)
        wait_until(lambda: len(conn.puts) == 3)
        assert conn.puts == ["r_0_0", "r_0_1", "r_0_2"]
        assert [conn.get(k) for k in conn.puts] == [
            {"data": "a", "finished": False},
            {"data": "b", "finished": False},
            {"data": None, "finished": True},
        ]
    finally:
        snd.stop()


def test_save_async_never_calls_build_and_returns_at_once(conn: MemoryConnector) -> None:
    gate = Gate("block")
    snd = ChunkAdapter(conn, stage_id=0, build_payload=gate)
    try:
        snd.save_async("r", "block", False)
        assert gate.entered.wait(10)
        t0 = time.perf_counter()
        for i in range(1000):
            snd.save_async("r", i, False)
        per_call_s = (time.perf_counter() - t0) / 1000
        # Not a benchmark: a generous bound that only a blocking call would exceed.
        assert per_call_s < 0.005
        assert conn.puts == []
        gate.release.set()
        wait_until(lambda: len(conn.puts) == 1001)
    finally:
        gate.release.set()
        snd.stop()


def test_ids_restart_at_0_after_a_final(conn: MemoryConnector) -> None:
    snd = ChunkAdapter(conn, stage_id=3)
    try:
        snd.save_async("r", "a", True)
        wait_until(lambda: len(conn.puts) == 1)
        snd.save_async("r", "b", True)
        wait_until(lambda: len(conn.puts) == 2)
        assert conn.puts == ["r_3_0", "r_3_0"]
    finally:
        snd.stop()


# --- receiver rules ------------------------------------------------------------


def test_chunks_put_before_load_async_are_received(
    pair: tuple[ChunkAdapter, ChunkAdapter], conn: Any
) -> None:
    snd, rcv = pair
    snd.save_async("early", "x", False)
    snd.save_async("early", "y", True)
    wait_until(lambda: len(conn.puts) == 2)
    rcv.load_async("early")
    assert [c["data"] for c in drain(rcv, "early", 2)] == ["x", "y"]


def test_load_async_is_idempotent_while_registered(pair: tuple[ChunkAdapter, ChunkAdapter]) -> None:
    snd, rcv = pair
    rcv.load_async("r")
    snd.save_async("r", "a", False)
    assert [c["data"] for c in drain(rcv, "r", 1)] == ["a"]
    rcv.load_async("r")  # must not reset the next id to 0
    snd.save_async("r", "b", True)
    assert [c["data"] for c in drain(rcv, "r", 1)] == ["b"]


def test_src_stage_id_reads_the_senders_keys(conn: MemoryConnector) -> None:
    snd = ChunkAdapter(conn, stage_id=0)
    rcv = ChunkAdapter(conn, stage_id=5, src_stage_id=0)
    try:
        rcv.load_async("r")
        snd.save_async("r", "a", True)
        assert drain(rcv, "r", 1) == [{"data": "a", "finished": True}]
    finally:
        snd.stop()
        rcv.stop()


def test_finished_chunk_unregisters_the_request(pair: tuple[ChunkAdapter, ChunkAdapter]) -> None:
    snd, rcv = pair
    rcv.load_async("r")
    snd.save_async("r", "a", True)
    drain(rcv, "r", 1)
    wait_until(lambda: rcv.pending_receives() == 0)


class BlockingGetConnector(MemoryConnector):
    """A fetch of a round containing `hold_key` blocks until `release` is set."""

    def __init__(self, hold_key: str) -> None:
        super().__init__()
        self.hold_key = hold_key
        self.in_get = threading.Event()
        self.release = threading.Event()

    def peek_many(self, keys: Any, delete_first: Any = ()) -> list[Any]:
        if self.hold_key in keys:
            values = super().peek_many(keys, delete_first)  # read before the barrier ...
            self.in_get.set()
            assert self.release.wait(10)  # ... commit attempted after it
            self.hold_key = ""
            return values
        return super().peek_many(keys, delete_first)


def test_cleanup_receiver_is_a_barrier_against_an_in_flight_get() -> None:
    conn = BlockingGetConnector(hold_key="r_0_0")
    rcv = ChunkAdapter(conn, stage_id=1)
    try:
        conn.put("r_0_0", {"data": "stale", "finished": False})
        rcv.load_async("r")
        assert conn.in_get.wait(10)
        rcv.cleanup_receiver("r")
        rcv.load_async("r")  # registered again with a fresh token
        conn.put("r_0_0", {"data": "fresh", "finished": True})  # before the stale read returns
        conn.release.set()
        wait_until(lambda: rcv.pending_receives() == 0)
        assert rcv.poll_ready() == {"r": [{"data": "fresh", "finished": True}]}
    finally:
        conn.release.set()
        rcv.stop()


def test_cleanup_receiver_drops_ready_chunks(pair: tuple[ChunkAdapter, ChunkAdapter]) -> None:
    snd, rcv = pair
    rcv.load_async("r")
    snd.save_async("r", "a", False)
    wait_until(lambda: rcv.received_chunks == 1)
    rcv.cleanup_receiver("r")
    assert rcv.poll_ready() == {}
    assert rcv.pending_receives() == 0


class FailingGetConnector(MemoryConnector):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def peek_many(self, keys: Any, delete_first: Any = ()) -> list[Any]:
        if self.failures > 0:
            self.failures -= 1
            raise OSError("connection reset")
        return super().peek_many(keys, delete_first)


def test_failing_get_does_not_kill_the_recv_thread() -> None:
    conn = FailingGetConnector(failures=3)
    rcv = ChunkAdapter(conn, stage_id=1)
    try:
        conn.put("r_0_0", {"data": "a", "finished": True})
        rcv.load_async("r")
        assert drain(rcv, "r", 1) == [{"data": "a", "finished": True}]
        assert rcv.failed_gets == 3
    finally:
        rcv.stop()


def test_malformed_chunk_is_counted_and_skipped(
    pair: tuple[ChunkAdapter, ChunkAdapter], conn: Any
) -> None:
    _snd, rcv = pair
    conn.put("r_0_0", {"unexpected": 1})
    conn.put("r_0_1", {"data": "ok", "finished": True})
    rcv.load_async("r")
    assert drain(rcv, "r", 1) == [{"data": "ok", "finished": True}]
    assert rcv.malformed_chunks == 1


def test_many_requests_keep_order_and_contiguous_ids(
    pair: tuple[ChunkAdapter, ChunkAdapter], conn: Any
) -> None:
    snd, rcv = pair
    n_req, n_chunks = 50, 20
    for r in range(n_req):
        rcv.load_async(f"r{r}")
    for i in range(n_chunks):
        for r in range(n_req):
            snd.save_async(f"r{r}", i, i == n_chunks - 1)
    got: dict[str, list[Any]] = {}

    def all_in() -> bool:
        for rid, chunks in rcv.poll_ready().items():
            got.setdefault(rid, []).extend(c["data"] for c in chunks)
        return rcv.pending_receives() == 0

    wait_until(all_in)
    all_in()
    assert got == {f"r{r}": list(range(n_chunks)) for r in range(n_req)}
    assert len(conn) == 0


def test_stop_returns_promptly_while_idle(conn: MemoryConnector) -> None:
    adapter = ChunkAdapter(conn, stage_id=1)
    adapter.load_async("idle")  # RECV thread polling, SAVE thread waiting
    wait_until(lambda: adapter.pending_receives() == 1)
    t0 = time.monotonic()
    adapter.stop()
    assert time.monotonic() - t0 < 1.0
    assert not adapter._save_thread.is_alive() and not adapter._recv_thread.is_alive()
