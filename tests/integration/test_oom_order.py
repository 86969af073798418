"""Redis short of memory refuses a command bigger than the room it has left and runs a
smaller one after it in the same pipeline. A request's outputs too big for one entry then
still reach their stream in order: each writer sends a request's next entry on a stream
only in the round trip after its first (`write_ops.first_wave`), and it waits behind the
first while that is held. Without that, a client saw a gap, and an orchestrator took the
first entry, written later, for a repeat and dropped it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.start import Observability
from omni_runtime.redis_io.backoff import Backoff, RetrySettings
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageOutputMsg
from omni_runtime.worker.actions import Outgoing
from omni_runtime.worker.output import OutputThread
from tests.redis_full import FullableRedis
from tests.waiting import wait_for, wait_until

pytestmark = pytest.mark.timeout(60)

ROOM_BYTES = 400_000
BIG, SMALL = 255_000, 10_000
"""Too big together for one entry. Redis counts a big argument twice while it runs the
command (the argument, and a query buffer as big made ready for the next), so with this
room it refuses the big entry and runs the small one."""


def seqs(client: redis.Redis, stream: str) -> list[tuple[str, int]]:
    """(request, seq) of each message on `stream`, in stream order (batches unpacked)."""
    got: list[tuple[str, int]] = []
    entries: Any = client.xrange(stream)
    for _id, fields in entries:
        msg = codec.decode(fields[keys.PAYLOAD_FIELD.encode()])
        for m in msg if isinstance(msg, list) else [msg]:
            m = codec.decode(m) if isinstance(m, bytes) else m
            got.append((m["request_id"], m["seq"]))
    return got


async def test_a_client_gets_a_requests_outputs_in_order_past_a_refused_bigger_entry(
    full_redis: FullableRedis,
) -> None:
    client = aioredis.Redis.from_url(full_redis.url)
    probe = redis.Redis.from_url(full_redis.url)
    writer = StreamWriter(
        client, 100, obs=Observability(metrics=Metrics()), backoff=Backoff(0.01, 0.05, 200)
    )
    task = asyncio.create_task(writer.run())
    try:
        with full_redis.short(ROOM_BYTES):
            for seq, size in enumerate((BIG, SMALL)):
                msg = {"request_id": "r", "seq": seq, "pad": b"x" * size}
                fields = {keys.PAYLOAD_FIELD: codec.encode(msg)}
                writer.xadd("out", fields, merge_up_to=codec.BATCH_MAX_BYTES, owner="r")
            await wait_for(lambda: writer.metrics.value("omni_redis_oom_refusals_total") >= 1, 10)
            assert seqs(probe, "out") == []
        await asyncio.wait_for(writer.flushed(), 10)
        assert seqs(probe, "out") == [("r", 0), ("r", 1)]
        assert writer.dropped_writes == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        probe.close()


def output(rid: str, seq: int, size: int, ends: bool = False) -> Outgoing:
    msg = StageOutputMsg(request_id=rid, data=b"x" * size, finished=ends, seq=seq)
    return Outgoing(rid, seq, codec.encode_model(msg), ends, False, b"1-0" if ends else None)


def test_an_orchestrator_gets_a_stages_outputs_in_order_past_a_refused_bigger_entry(
    full_redis: FullableRedis,
) -> None:
    client = redis.Redis.from_url(full_redis.url)
    client.xgroup_create("in", keys.WORKERS_GROUP, id="0", mkstream=True)
    client.xadd("in", {keys.PAYLOAD_FIELD: b"r"}, id="1-0")
    client.xreadgroup(keys.WORKERS_GROUP, "w", {"in": ">"})
    retry = RetrySettings(0.01, 0.05, 200)
    lost: list[Any] = []
    thread = OutputThread(
        client, "out", "in", maxlen=100, backoff=lambda: retry.backoff(bounded=True),
        on_lost=lambda outs, reason: lost.append(reason), metrics=Metrics(),
        max_batch_bytes=codec.BATCH_MAX_BYTES,
    )  # fmt: skip
    thread.start()
    try:
        with full_redis.short(ROOM_BYTES):
            thread.publish([output("r", 0, BIG), output("r", 1, SMALL, ends=True)], [])
            wait_until(lambda: thread.metrics.value("omni_redis_oom_refusals_total") >= 1)
            assert seqs(client, "out") == []
        wait_until(lambda: thread.idle())
        assert seqs(client, "out") == [("r", 0), ("r", 1)]
        assert client.xlen("in") == 0 and lost == []
    finally:
        thread.request_stop()
        thread.join(5)
        client.close()
