"""XREADGROUP packed and parsed by hand (`redis_io/raw_reads.py`) reads what redis-py's
command path reads, in either protocol, and leaves the connection in step after an error
reply (real redis-server)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from omni_runtime.redis_io.raw_reads import xreadgroup_sync

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def own(request: pytest.FixtureRequest, redis_url: str) -> Iterator[redis.Redis]:
    """A single-connection client (the raw path) in either protocol."""
    client = redis.Redis.from_url(redis_url, single_connection_client=True, protocol=request.param)
    try:
        yield client
    finally:
        client.close()


def test_new_entries_then_a_backlog_with_a_trimmed_one_then_nothing(own: redis.Redis) -> None:
    own.xgroup_create("s", "g", id="0", mkstream=True)
    first = own.xadd("s", {"m": b"1"})
    own.xadd("s", {"m": b"2", "n": b"x"})
    got = xreadgroup_sync(own, "g", "c", {"s": ">"}, 10, 0)
    assert [(name, [f for _i, f in entries]) for name, entries in got] == [
        (b"s", [{b"m": b"1"}, {b"m": b"2", b"n": b"x"}])
    ]
    own.xdel("s", first)  # read, then trimmed before it was handled
    backlog = xreadgroup_sync(own, "g", "c", {"s": "0"}, 10, 0)
    assert [f for _i, f in backlog[0][1]] == [{}, {b"m": b"2", b"n": b"x"}]
    assert xreadgroup_sync(own, "g", "c", {"s": ">"}, 10, 1) == []  # blocked 1 ms: None


def test_an_error_reply_raises_and_the_connection_reads_on(own: redis.Redis) -> None:
    with pytest.raises(redis.exceptions.ResponseError, match="NOGROUP"):
        xreadgroup_sync(own, "g", "c", {"nothing": ">"}, 10, 0)
    own.xgroup_create("s", "g", id="0", mkstream=True)
    own.xadd("s", {"m": b"1"})
    assert [f for _i, f in xreadgroup_sync(own, "g", "c", {"s": ">"}, 10, 0)[0][1]] == [
        {b"m": b"1"}
    ]


def test_a_client_of_many_connections_reads_through_redis_py(redis_url: str) -> None:
    shared = redis.Redis.from_url(redis_url)
    try:
        shared.xgroup_create("s", "g", id="0", mkstream=True)
        shared.xadd("s", {"m": b"1"})
        got = xreadgroup_sync(shared, "g", "c", {"s": ">"}, 10, 0)
        assert [(name, [f for _i, f in entries]) for name, entries in got] == [
            (b"s", [{b"m": b"1"}])
        ]
    finally:
        shared.close()
