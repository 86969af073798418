"""While Redis refuses every write for memory, nobody is taken for dead or deposed: lease
rounds, worker heartbeats, the worker's output thread and chunk reads go on with the
commands Redis still runs (GET, PEXPIRE, XACK, XDEL, GETDEL), and write the rest once it
has room."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from omni_runtime import keys
from omni_runtime.chunks.redis import RedisConnector
from omni_runtime.errors import OOM_MESSAGE
from omni_runtime.keys import Names
from omni_runtime.observe.metrics import Metrics
from omni_runtime.orchestrator.leases import Leases
from omni_runtime.redis_io.backoff import RetrySettings
from omni_runtime.redis_io.entries import parse_entries
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageOutputMsg
from omni_runtime.worker.actions import Outgoing
from omni_runtime.worker.io_threads import HeartbeatThread
from omni_runtime.worker.output import OutputThread
from tests.redis_full import FullableRedis
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

NAMES = Names("t")
TTL_S = 1.0


async def test_lease_rounds_hold_the_slot_while_redis_is_out_of_memory(
    full_redis: FullableRedis,
) -> None:
    """Redis refuses every command inside a MULTI then, even a GET: the round goes without."""
    client = aioredis.Redis.from_url(full_redis.url)
    leases = Leases(client, NAMES, TTL_S)
    try:
        assert await leases.take(0)
        with full_redis.full():
            until = time.monotonic() + 3 * TTL_S
            while time.monotonic() < until:
                assert await leases.refresh() == {0}
                await asyncio.sleep(TTL_S / 4)
            assert leases.fresh() and not leases.lost
            assert await client.get(NAMES.orchestrator_lease(0)) == leases.token.encode()
    finally:
        await client.aclose()


def test_a_worker_heartbeat_lives_on_while_redis_is_out_of_memory(
    full_redis: FullableRedis,
) -> None:
    client = redis.Redis.from_url(full_redis.url)
    status = {"in_flight": 0}
    beat = HeartbeatThread(client, "hb", 0.1, int(TTL_S * 1000), lambda: dict(status), lambda: None)
    try:
        beat.beat()
        with full_redis.full():
            status["in_flight"] = 7
            until = time.monotonic() + 3 * TTL_S
            while time.monotonic() < until:
                beat.beat()  # the SET is refused; its PEXPIRE keeps the key
                time.sleep(TTL_S / 4)
            assert json.loads(client.get("hb") or b"{}") == {"in_flight": 0}  # a beat old
        beat.beat()
        assert json.loads(client.get("hb") or b"{}") == {"in_flight": 7}
    finally:
        client.close()


def out(rid: str, seq: int, ends: bool = False) -> Outgoing:
    msg = StageOutputMsg(request_id=rid, data=f"{rid}{seq}", finished=ends, seq=seq)
    ack = f"{ord(rid)}-0".encode() if ends else None  # its input's entry id
    return Outgoing(rid, seq, codec.encode_model(msg), ends, False, ack)


def published(client: redis.Redis) -> list[list[tuple[str, int]]]:
    """The output stream's entries, each as the (request, seq) it carries."""
    entries: Any = client.xrange("out")
    return [
        [(m.request_id, m.seq) for m in parse_entries(fields, StageOutputMsg, 1 << 20)]
        for _id, fields in entries
    ]


def output_thread(client: redis.Redis, lost: list[Any], attempts: int) -> OutputThread:
    retry = RetrySettings(0.01, 0.05, attempts)
    thread = OutputThread(
        client,
        "out",
        "in",
        maxlen=100,
        backoff=lambda: retry.backoff(bounded=True),
        on_lost=lambda outs, reason: lost.append((outs, reason)),
        metrics=Metrics(),
    )
    thread.start()
    return thread


def test_refused_outputs_go_again_once_per_request_their_inputs_freed_at_once(
    full_redis: FullableRedis,
) -> None:
    """The XACK and XDEL go through (they free memory); the entries Redis refused are
    written once it has room, one per request (smaller gets through sooner), in order."""
    client = redis.Redis.from_url(full_redis.url)
    client.xgroup_create("in", keys.WORKERS_GROUP, id="0", mkstream=True)
    for rid in ("a", "b"):
        client.xadd("in", {keys.PAYLOAD_FIELD: rid.encode()}, id=f"{ord(rid)}-0")
    client.xreadgroup(keys.WORKERS_GROUP, "w", {"in": ">"})
    lost: list[Any] = []
    thread = output_thread(client, lost, attempts=50)
    try:
        with full_redis.full():
            thread.publish([out("a", 0), out("b", 0), out("a", 1, ends=True)], [b"98-0"])
            wait_until(lambda: client.xlen("in") == 0)  # both inputs acked and deleted
            assert client.xlen("out") == 0
        wait_until(lambda: thread.idle())
        assert sorted(published(client)) == [[("a", 0), ("a", 1)], [("b", 0)]]
        assert lost == [] and thread.metrics.value("omni_redis_oom_refusals_total") >= 1
    finally:
        thread.request_stop()
        thread.join(5)
        client.close()


def test_outputs_refused_for_memory_too_long_end_their_requests(
    full_redis: FullableRedis,
) -> None:
    client = redis.Redis.from_url(full_redis.url)
    lost: list[Any] = []
    thread = output_thread(client, lost, attempts=3)
    try:
        with full_redis.full():
            thread.publish([out("a", 0)], [])
            wait_until(lambda: bool(lost))
        ((outs, reason),) = lost
        assert [o.request_id for o in outs] == ["a"] and reason.startswith(OOM_MESSAGE)
    finally:
        thread.request_stop()
        thread.join(5)
        client.close()


def test_chunks_are_read_and_freed_while_redis_is_out_of_memory(
    full_redis: FullableRedis,
) -> None:
    """A chunk read is a MULTI of MGET and UNLINK, which Redis full refuses whole: it goes
    as per-key GETDELs then, which free the memory of what they read."""
    connector = RedisConnector.from_url(full_redis.url, prefix="t")
    probe = redis.Redis.from_url(full_redis.url)
    try:
        connector.put_batch([("r_0_0", {"data": "a", "finished": False}, False)])
        connector.put_batch([("r_0_1", {"data": "b", "finished": True}, True)])
        with full_redis.full():
            fetched = connector.fetch(["r_0_0", "r_0_1", "r_0_2"])
            assert [f and f["data"] for f in fetched] == ["a", "b", None]
            assert list(probe.scan_iter("t:chunk:{r}*")) == []
    finally:
        connector.close()
        probe.close()
