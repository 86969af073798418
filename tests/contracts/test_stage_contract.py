"""The stage contract (SPEC §2, §5), over every stage the orchestrator may be given.

`InMemoryStage`, and `RedisStageClient` on fakeredis and on a real redis-server,
must behave alike: `get_output` waits and batches, keeps each stage's order, and
a durable stage acknowledges an entry only after `output_handled`. Repeats (by
`seq`) and malformed entries concern only the Redis stage.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import fakeredis
import numpy as np
import pytest
import redis.asyncio as aioredis

from omni_runtime import keys
from omni_runtime.core.in_memory import InMemoryStage
from omni_runtime.core.types import ManagedStage, StageFailure, StageOutput
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.start import Observability
from omni_runtime.orchestrator.stage_client import RedisStageClient
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.streams import Entry, ensure_group, entry_fields, parse_entry
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageInputMsg, StageOutputMsg

pytestmark = pytest.mark.timeout(60)

NAMES = keys.Names("contract")
SID = 1


class MemoryHarness:
    """Drives an `InMemoryStage` the way a worker drives a Redis stage."""

    def __init__(self) -> None:
        self.stage = InMemoryStage()
        self.metrics = Metrics()

    async def emit(self, rid: str, data: Any, finished: bool = False, seq: int = 0) -> None:
        self.stage.emit(StageOutput(rid, data, finished))

    async def close(self) -> None:
        pass


class RedisHarness:
    """A `RedisStageClient` with its writer running; `emit` writes as a worker would."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.obs = Observability()
        self.metrics = self.obs.metrics
        self.writer = StreamWriter(client, keys.STREAM_MAXLEN, obs=self.obs)
        self.stage = RedisStageClient(
            client, self.writer, SID, NAMES, read_count=64, block_ms=50,
            max_message_bytes=1 << 20, obs=self.obs, backoff=Backoff(0.001, 0.01, 5),
        )  # fmt: skip
        self._writer_task = asyncio.create_task(self.writer.run())

    async def emit(self, rid: str, data: Any, finished: bool = False, seq: int = 0) -> None:
        msg = StageOutputMsg(request_id=rid, data=data, finished=finished, seq=seq)
        await self.client.xadd(NAMES.stage_out(SID), entry_fields(msg))  # type: ignore[arg-type]

    async def unacked(self) -> int:
        summary = await self.client.xpending(NAMES.stage_out(SID), keys.ORCHESTRATOR_GROUP)
        return int(summary["pending"])

    async def close(self) -> None:
        await self.stage.quiesce()
        self._writer_task.cancel()
        await asyncio.gather(self._writer_task, return_exceptions=True)
        await self.client.aclose()


Harness = MemoryHarness | RedisHarness


async def _redis_harness(request: pytest.FixtureRequest) -> RedisHarness:
    if request.param == "fakeredis":
        client: aioredis.Redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    else:
        client = aioredis.Redis.from_url(request.getfixturevalue("redis_url"))
    await ensure_group(client, NAMES.stage_out(SID), keys.ORCHESTRATOR_GROUP)
    return RedisHarness(client)


@pytest.fixture(params=["memory", "fakeredis", "redis"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    h: Harness = MemoryHarness() if request.param == "memory" else await _redis_harness(request)
    try:
        yield h
    finally:
        await h.close()


@pytest.fixture(params=["fakeredis", "redis"])
async def redis_harness(request: pytest.FixtureRequest) -> AsyncIterator[RedisHarness]:
    """A stage over Redis: only it sees re-runs (seq), error entries and untrusted entries."""
    h = await _redis_harness(request)
    try:
        yield h
    finally:
        await h.close()


async def outputs(h: Harness, n: int) -> list[StageOutput]:
    """Call `get_output` until `n` outputs came; the calls' results in order."""
    got: list[StageOutput] = []
    async with asyncio.timeout(10):
        while len(got) < n:
            got.extend(await h.stage.get_output())
    assert len(got) == n
    return got


def triples(outs: list[StageOutput]) -> list[tuple[str, Any, bool]]:
    return [(o.request_id, o.data, o.finished) for o in outs]


async def test_is_a_managed_stage(harness: Harness) -> None:
    assert isinstance(harness.stage, ManagedStage)


async def test_get_output_waits_until_an_output_exists(harness: Harness) -> None:
    task = asyncio.create_task(harness.stage.get_output())
    done, _ = await asyncio.wait({task}, timeout=0.1)
    assert not done  # nothing to return yet: it waits
    await harness.emit("r1", "a")
    async with asyncio.timeout(10):
        assert triples(await task) == [("r1", "a", False)]


async def test_get_output_returns_what_accumulated_in_one_batch(harness: Harness) -> None:
    for i in range(3):
        await harness.emit(f"r{i}", i)
    batch = await harness.stage.get_output()
    assert triples(batch) == [("r0", 0, False), ("r1", 1, False), ("r2", 2, False)]


async def test_outputs_keep_the_stage_order_across_requests(harness: Harness) -> None:
    sent = [(f"r{i % 3}", i, i >= 9) for i in range(12)]
    for rid, data, finished in sent:
        await harness.emit(rid, data, finished, seq=data // 3)
    assert triples(await outputs(harness, 12)) == sent


async def test_acknowledged_only_after_output_handled(harness: Harness) -> None:
    await harness.emit("r1", "a")
    await harness.emit("r1", "b", True, seq=1)
    first, second = await outputs(harness, 2)
    if isinstance(harness, MemoryHarness):
        harness.stage.output_handled(first)
        assert harness.stage.handled == [first]
        return
    assert await harness.unacked() == 2
    harness.stage.output_handled(second)  # any order: each output names its entry
    await harness.writer.flushed()
    assert await harness.unacked() == 1
    harness.stage.output_handled(first)
    await harness.writer.flushed()
    assert await harness.unacked() == 0


async def test_submit_reaches_the_stage(harness: Harness) -> None:
    await harness.stage.submit("r1", {"prompt": "hi"})
    if isinstance(harness, MemoryHarness):
        assert harness.stage.submitted == [("r1", {"prompt": "hi"})]
        return
    await harness.writer.flushed()
    [(_id, fields)] = cast("list[Entry]", await harness.client.xrange(NAMES.stage_in(SID)))
    msg = parse_entry(fields, StageInputMsg, 1 << 20)
    assert (msg.request_id, msg.data, msg.streaming) == ("r1", {"prompt": "hi"}, False)


async def test_repeated_seq_is_dropped_even_after_finished(redis_harness: RedisHarness) -> None:
    harness = redis_harness
    await harness.emit("r1", "a", seq=0)
    await harness.emit("r1", "a", seq=0)  # a replica re-ran the request
    await harness.emit("r1", "b", True, seq=1)
    await harness.emit("r1", "b", True, seq=1)  # late repeat after the stage finished
    await harness.emit("r2", "x", True, seq=0)
    assert triples(await outputs(harness, 3)) == [
        ("r1", "a", False),
        ("r1", "b", True),
        ("r2", "x", True),
    ]
    assert harness.metrics.value("omni_duplicate_outputs_total", stage=SID) == 2
    await harness.writer.flushed()
    assert await harness.unacked() == 3  # the repeats were acknowledged at once
    harness.stage.request_ended("r1")
    harness.stage.request_ended("r2")
    assert len(harness.stage.seq) == 0  # memory follows live requests


async def test_an_entry_of_several_outputs_is_acknowledged_when_all_were_handled(
    redis_harness: RedisHarness,
) -> None:
    harness = redis_harness
    msgs = [
        StageOutputMsg(request_id="r1", data="a", finished=False, seq=0),
        StageOutputMsg(request_id="r2", data="x", finished=True, seq=0),
        StageOutputMsg(request_id="r1", data="b", finished=True, seq=1),
    ]
    batch = codec.encode_batch([codec.encode_model(m) for m in msgs])
    await harness.client.xadd(NAMES.stage_out(SID), {keys.PAYLOAD_FIELD: batch})
    await harness.emit("r1", "a", seq=0)  # a repeat, alone in its entry: done with at once
    got = await outputs(harness, 3)
    assert triples(got) == [("r1", "a", False), ("r2", "x", True), ("r1", "b", True)]
    await harness.writer.flushed()
    assert await harness.unacked() == 1
    for out in got[:2]:
        harness.stage.output_handled(out)
        await harness.writer.flushed()
        assert await harness.unacked() == 1  # one output of the entry is still in flight
    harness.stage.output_handled(got[2])
    await harness.writer.flushed()
    assert await harness.unacked() == 0


async def test_error_output_passes_whatever_its_seq(redis_harness: RedisHarness) -> None:
    harness = redis_harness
    await harness.emit("r1", "a", seq=0)
    msg = StageOutputMsg(request_id="r1", data=None, finished=False, error="boom", seq=0)
    await harness.client.xadd(NAMES.stage_out(SID), entry_fields(msg))  # type: ignore[arg-type]
    _a, failed = await outputs(harness, 2)
    assert failed.finished and isinstance(failed.data, StageFailure)
    assert "boom" in failed.data.error


async def test_malformed_entry_is_dead_lettered(redis_harness: RedisHarness) -> None:
    harness = redis_harness
    out = NAMES.stage_out(SID)
    await harness.client.xadd(out, {keys.PAYLOAD_FIELD: b"\xc1"})
    await harness.client.xadd(out, {keys.PAYLOAD_FIELD: codec.encode({"type": "stage_output"})})
    await harness.emit("r1", "ok", True)
    assert triples(await outputs(harness, 1)) == [("r1", "ok", True)]
    assert await harness.client.xlen(NAMES.dead_letters) == 2
    assert await harness.unacked() == 1  # only the good one waits for output_handled
    assert harness.stage.malformed_entries == 2
    assert harness.metrics.value("omni_dead_letters_total", stream=out) == 2


async def test_a_relaying_stage_holds_each_outputs_own_bytes(redis_harness: RedisHarness) -> None:
    """Streaming mode relays data as read: each output holds its own bytes (not a view into
    the batch it came in, which it would keep alive), and they encode back unchanged."""
    h = redis_harness
    stage = RedisStageClient(
        h.client, h.writer, SID, NAMES, read_count=64, block_ms=50,
        max_message_bytes=1 << 20, obs=h.obs, relay=True,
    )  # fmt: skip
    pcm = np.arange(1600, dtype=np.float32)
    values = ["tok", pcm, {"k": [1, 2]}]
    msgs = [
        StageOutputMsg(request_id=f"r{i}", data=v, finished=False) for i, v in enumerate(values)
    ]
    batch = codec.encode_batch([codec.encode_model(m) for m in msgs])
    await h.client.xadd(NAMES.stage_out(SID), {keys.PAYLOAD_FIELD: batch})
    async with asyncio.timeout(10):
        outs = await stage.get_output()
    assert [o.request_id for o in outs] == ["r0", "r1", "r2"]
    for out, value in zip(outs, values, strict=True):
        assert out.data.copy() is out.data  # msgspec copies a Raw only if it is a view
        assert codec.encode_decoded({"d": out.data}) == codec.encode({"d": value})
