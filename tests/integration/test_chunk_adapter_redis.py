"""The ChunkAdapter over Redis: two connectors (as in two processes), wake-ups, look-ahead."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
import redis

from omni_runtime import ChunkAdapter
from omni_runtime.chunks import RedisConnector
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

REAL = pytest.param("redis-server", marks=pytest.mark.redis_server)


@pytest.fixture(params=["fakeredis", REAL])
def make_connector(request: pytest.FixtureRequest) -> Iterator[Callable[[], RedisConnector]]:
    made: list[RedisConnector] = []
    clients: list[redis.Redis] = []
    server = fakeredis.FakeServer()

    def make() -> RedisConnector:
        if request.param == "fakeredis":
            client = fakeredis.FakeRedis(server=server)
            clients.append(client)
            conn = RedisConnector(client, prefix="t:")
        else:
            conn = RedisConnector.from_url(request.getfixturevalue("redis_url"), prefix="t:")
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.close()
    for client in clients:
        client.close()


def test_seed_snapshot_isolation_over_redis(make_connector: Callable[[], RedisConnector]) -> None:
    snd = ChunkAdapter(make_connector(), stage_id=0)
    rcv = ChunkAdapter(make_connector(), stage_id=1)
    try:
        live = ["a"]
        rcv.load_async("v")
        snd.save_async("v", live, is_final=False)
        live.append("b")
        snd.save_async("v", live, is_final=True)
        live.append("c")
        got: list[Any] = []
        wait_until(lambda: got.extend(rcv.poll_ready().get("v", [])) or len(got) == 2)
        assert [c["data"] for c in got] == [["a"], ["a", "b"]]
    finally:
        snd.stop()
        rcv.stop()


def test_many_requests_in_order_and_nothing_left_behind(
    make_connector: Callable[[], RedisConnector],
) -> None:
    sender_conn = make_connector()
    snd = ChunkAdapter(sender_conn, stage_id=0)
    rcv = ChunkAdapter(make_connector(), stage_id=1)
    n_req, n_chunks = 30, 15
    try:
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
        # every chunk consumed, every route dropped: no key names a request any more
        wait_until(lambda: not [k for k in sender_conn.client.keys("t:*") if b":notify:" not in k])
    finally:
        snd.stop()
        rcv.stop()
