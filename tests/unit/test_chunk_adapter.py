"""ChunkAdapter rules that need a particular transport: a bare SPEC connector, failing puts,
chunks a transport rejects, and the counters registry."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import fakeredis
import pytest

from omni_runtime import ChunkAdapter
from omni_runtime.chunks import MemoryConnector, PollingTransport, RedisConnector
from omni_runtime.chunks.transport import PutItem
from omni_runtime.observe.metrics import Metrics
from tests.fakes import Gate
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


class PlainConnector:
    """Only the duck-typed minimum of SPEC §2 (put, consuming get)."""

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


class FlakyBatchTransport(MemoryConnector):
    """`put_batch` (all or nothing) fails on its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str]] = []

    def put_batch(self, items: Sequence[PutItem]) -> None:
        self.batches.append([k for k, _v, _l in items])
        if len(self.batches) == 1:
            raise OSError("redis went away")
        super().put_batch(items)


@pytest.fixture
def adapters() -> Iterator[list[ChunkAdapter]]:
    made: list[ChunkAdapter] = []
    yield made
    for adapter in made:
        adapter.stop()


def test_a_bare_spec_connector_is_lifted_into_a_polling_transport(
    adapters: list[ChunkAdapter],
) -> None:
    conn = PlainConnector()
    snd, rcv = ChunkAdapter(conn, 0), ChunkAdapter(conn, 1)
    adapters += [snd, rcv]
    assert isinstance(snd.transport, PollingTransport)
    rcv.load_async("r")
    snd.save_async("r", "a", True)
    wait_until(lambda: rcv.pending_receives() == 0)
    assert rcv.poll_ready() == {"r": [{"data": "a", "finished": True}]}
    assert conn.puts == ["r_0_0"]


def test_id_advances_only_on_successful_put(adapters: list[ChunkAdapter]) -> None:
    conn = FlakyConnector(fail_calls={1})
    snd = ChunkAdapter(conn, stage_id=0)
    adapters.append(snd)
    for i, final in ((0, False), (1, False), (2, False), (3, True)):
        snd.save_async("r", i, final)
    wait_until(lambda: conn.calls == 4)
    m = snd.metrics
    wait_until(lambda: m.value("omni_chunks_sent_total") == 3)
    assert m.value("omni_chunk_put_failures_total") == 1
    assert conn.puts == ["r_0_0", "r_0_1", "r_0_2"]
    assert [(conn.get(k) or {}).get("data") for k in conn.puts] == [0, 2, 3]


def test_a_failed_batch_advances_no_id(adapters: list[ChunkAdapter]) -> None:
    transport = FlakyBatchTransport()
    gate = Gate("hold")
    snd = ChunkAdapter(transport, stage_id=0, build_payload=gate)
    adapters.append(snd)
    try:
        snd.save_async("x", "hold", True)  # holds the SAVE thread so the next ones queue up
        assert gate.entered.wait(10)
        for i in range(3):
            snd.save_async("r", i, False)
    finally:
        gate.release.set()
    wait_until(lambda: snd.metrics.value("omni_chunk_put_failures_total") == 4)
    assert transport.batches == [["x_0_0", "r_0_0", "r_0_1", "r_0_2"]]
    snd.save_async("r", "again", True)
    wait_until(lambda: transport.puts == ["r_0_0"])  # id 0 again: nothing advanced


def test_a_chunk_that_cannot_be_put_fails_alone(
    adapters: list[ChunkAdapter], fake_server: fakeredis.FakeServer
) -> None:
    """Too large (or unencodable): dropped and counted; other requests' chunks of the same
    batch go out; a rejected final still goes out, with data None."""
    client = fakeredis.FakeRedis(server=fake_server)
    transport = RedisConnector(client, max_bytes=1000)
    gate = Gate("hold")
    metrics = Metrics()
    snd = ChunkAdapter(transport, stage_id=0, build_payload=gate, metrics=metrics)
    adapters.append(snd)
    try:
        snd.save_async("x", "hold", True)
        assert gate.entered.wait(10)
        snd.save_async("a", "ok", False)
        snd.save_async("b", b"\0" * 2000, False)  # too large
        snd.save_async("b", "next", False)
        snd.save_async("a", {1, 2}, True)  # a set does not encode
        snd.save_async("b", b"\0" * 2000, True)
    finally:
        gate.release.set()
    wait_until(lambda: metrics.value("omni_chunks_sent_total") == 5)
    assert metrics.value("omni_chunks_dropped_total") == 3
    assert metrics.value("omni_chunk_put_failures_total") == 0
    got = {k: transport.get(k) for k in ("x_0_0", "a_0_0", "a_0_1", "b_0_0", "b_0_1")}
    assert got == {
        "x_0_0": {"data": "hold", "finished": True},
        "a_0_0": {"data": "ok", "finished": False},
        "a_0_1": {"data": None, "finished": True},
        "b_0_0": {"data": "next", "finished": False},
        "b_0_1": {"data": None, "finished": True},
    }
    client.close()


def test_the_size_limit_passed_down_is_the_one_reads_use(
    adapters: list[ChunkAdapter], fake_server: fakeredis.FakeServer
) -> None:
    clients = [fakeredis.FakeRedis(server=fake_server) for _ in range(2)]
    snd = ChunkAdapter(RedisConnector(clients[0], max_bytes=10_000), stage_id=0)
    rcv = ChunkAdapter(RedisConnector(clients[1], max_bytes=1000), stage_id=1)
    adapters += [snd, rcv]
    rcv.load_async("r")
    snd.save_async("r", b"\0" * 2000, False)
    snd.save_async("r", "end", True)
    wait_until(lambda: rcv.pending_receives() == 0)
    assert rcv.poll_ready() == {"r": [{"data": "end", "finished": True}]}
    assert rcv.metrics.value("omni_malformed_chunks_total") == 1
    for client in clients:
        client.close()


def test_counters_go_to_the_registry_given(adapters: list[ChunkAdapter]) -> None:
    metrics = Metrics()
    transport = MemoryConnector()
    snd = ChunkAdapter(transport, 0, metrics=metrics)
    rcv = ChunkAdapter(MemoryConnector(share=transport), 1, metrics=metrics)
    adapters += [snd, rcv]
    rcv.load_async("r")
    snd.save_async("r", "a", True)
    wait_until(lambda: metrics.value("omni_chunks_received_total", stage=1) == 1)
    assert metrics.value("omni_chunks_sent_total", stage=0) == 1
