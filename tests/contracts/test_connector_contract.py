"""The SPEC connector contract, over three connectors: in memory, Redis on fakeredis, Redis
on a real redis-server (the transport surface has its own suite).

SPEC §2: `put(key, obj)`, `get(key) -> obj | None`; `get` consumes, `None` means
not there yet. SPEC §5: the Redis connector SETs with a TTL, consumes with
GETDEL, msgpack on the wire, optional namespace prefix.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import fakeredis
import numpy as np
import pytest

from omni_runtime import keys
from omni_runtime.chunks import MemoryConnector, RedisConnector
from omni_runtime.chunks.transport import Connector

AnyConnector = MemoryConnector | RedisConnector

REAL = pytest.param("redis-server", marks=pytest.mark.redis_server)


@pytest.fixture(params=["memory", "fakeredis", REAL])
def connector(request: pytest.FixtureRequest) -> Iterator[AnyConnector]:
    """Each implementation of the connector protocol, empty."""
    if request.param == "memory":
        yield MemoryConnector()
    elif request.param == "fakeredis":
        client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
        yield RedisConnector(client)
        client.close()
    else:
        with RedisConnector.from_url(request.getfixturevalue("redis_url")) as conn:
            yield conn


# --- the protocol, for every implementation ----------------------------------------


def test_every_connector_satisfies_the_connector_protocol(connector: AnyConnector) -> None:
    assert isinstance(connector, Connector)
    assert not isinstance(object(), Connector)


def test_put_then_get_returns_an_equal_object(connector: AnyConnector) -> None:
    chunk = {"data": ["hi", "there"], "finished": False}
    connector.put("r1_0_0", chunk)
    assert connector.get("r1_0_0") == chunk


def test_get_consumes_the_key(connector: AnyConnector) -> None:
    connector.put("r1_0_0", {"data": 1, "finished": True})
    assert connector.get("r1_0_0") == {"data": 1, "finished": True}
    assert connector.get("r1_0_0") is None


def test_missing_key_is_none(connector: AnyConnector) -> None:
    assert connector.get("never_0_0") is None


def test_put_replaces_an_unread_value(connector: AnyConnector) -> None:
    connector.put("r1_0_0", {"data": "old", "finished": False})
    connector.put("r1_0_0", {"data": "new", "finished": False})
    assert connector.get("r1_0_0") == {"data": "new", "finished": False}


def test_bytes_and_nested_values_round_trip(connector: AnyConnector) -> None:
    chunk = {
        "data": {
            "pcm": bytes(range(256)) * 4,
            "codes": [[1, 2, 3], [4, 5, 6], []],
            "meta": {"sample_rate": 24000, "gain": 0.5, "tags": ["a", None, True], "empty": {}},
            "text": "héllo 🎵",
        },
        "finished": False,
    }
    connector.put(keys.chunk_key("req-1", 1, 7), chunk)
    assert connector.get("req-1_1_7") == chunk


def test_large_binary_value_round_trips(connector: AnyConnector) -> None:
    blob = bytes(range(256)) * (4 * 4096)  # 4 MiB: the Python packer sends it as its own buffer
    connector.put("big_0_0", {"data": blob, "finished": False})
    got = connector.get("big_0_0")
    assert got is not None
    assert got["data"] == blob


def test_numpy_array_round_trips_with_dtype_and_shape(connector: AnyConnector) -> None:
    codes = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    connector.put("t_1_0", {"data": {"codes": codes}, "finished": False})
    got = connector.get("t_1_0")
    assert got is not None
    assert got["data"]["codes"].dtype == np.int32
    np.testing.assert_array_equal(got["data"]["codes"], codes)


def test_none_data_in_a_final_chunk_round_trips(connector: AnyConnector) -> None:
    connector.put("w_0_1", {"data": None, "finished": True})
    assert connector.get("w_0_1") == {"data": None, "finished": True}


def test_each_value_is_consumed_by_exactly_one_of_several_racing_readers(
    connector: AnyConnector,
) -> None:
    names = [f"race_0_{i}" for i in range(100)]
    for i, name in enumerate(names):
        connector.put(name, {"data": i, "finished": False})
    received: list[list[Any]] = [[] for _ in range(4)]

    def reader(slot: int) -> None:
        for name in names:
            value = connector.get(name)
            if value is not None:
                received[slot].append(value["data"])

    threads = [threading.Thread(target=reader, args=(slot,)) for slot in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert sorted(v for got in received for v in got) == list(range(100))


# --- memory specifics --------------------------------------------------------------------


def test_memory_connector_records_every_put_key_in_order() -> None:
    conn = MemoryConnector()
    conn.put("v_0_0", {"data": ["a"], "finished": False})
    conn.put("v_0_1", {"data": ["a", "b"], "finished": True})
    conn.get("v_0_0")
    assert conn.puts == ["v_0_0", "v_0_1"]
    assert len(conn) == 1
