"""SPEC §3 over the Redis transport: service, workers and client on one fakeredis server."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from omni_runtime import keys
from omni_runtime.core.tasks import cancel_and_wait
from omni_runtime.pipeline import PipelineConfig, load_pipeline
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.streams import entry_fields, stream_reply
from omni_runtime.redis_io.write_ops import xadd_fields
from omni_runtime.settings import Settings
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageOutputMsg
from tests.cluster import InProcessCluster
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

WORKERS = Path(__file__).resolve().parents[2] / "workers"


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def fake_clients(server: fakeredis.FakeServer) -> RedisClients:
    return RedisClients(
        sync=lambda: fakeredis.FakeRedis(server=server),
        aio=lambda: fakeredis.FakeAsyncRedis(server=server),
    )


@pytest.fixture
def settings() -> Settings:
    return Settings(
        redis_url="redis://unused",
        block_ms=20,
        orchestrator_idle_block_ms=20,  # fakeredis goes on with a cancelled blocking read
        heartbeat_interval_s=0.2,
    )


def seed(**update: Any) -> PipelineConfig:
    return load_pipeline(WORKERS / "seed.yaml").model_copy(update=update)


@pytest.fixture
async def seed_cluster(
    fake_clients: RedisClients, settings: Settings
) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(seed(), settings, fake_clients) as c:
        yield c


def triples(outs: list[Any]) -> list[tuple[int, Any, bool]]:
    return [(o.stage_id, o.data, o.finished) for o in outs]


async def test_seed_finals_0_and_2_over_redis(seed_cluster: InProcessCluster) -> None:
    outs = await seed_cluster.run("hi there")
    assert triples(outs) == [
        (0, "hi", False),
        (0, "there", False),
        (2, "wav:HI", False),
        (2, "wav:THERE", True),
    ]
    assert all(o.error is None for o in outs)
    orch = seed_cluster.service.orchestrator
    await wait_for(lambda: orch.request_states == {})
    assert orch.dropped_outputs == 0


async def test_seed_final_2_only_over_redis(fake_clients: RedisClients, settings: Settings) -> None:
    async with InProcessCluster(seed(final_stage_ids=[2]), settings, fake_clients) as c:
        outs = await c.run("a b c")
    assert triples(outs) == [(2, "wav:A", False), (2, "wav:B", False), (2, "wav:C", True)]


async def test_seed_ghost_and_late_outputs_dropped_over_redis(
    fake_clients: RedisClients, settings: Settings
) -> None:
    async with InProcessCluster(seed(final_stage_ids=[2]), settings, fake_clients) as c:
        raw = fake_clients.aio()
        names = settings.names
        ghost = StageOutputMsg(request_id="ghost", data="?", finished=True)
        await raw.xadd(names.stage_out(1), xadd_fields(entry_fields(ghost)))
        outs = await c.run("hi there", request_id="r1")
        late = StageOutputMsg(request_id="r1", data="wav:LATE", finished=True, seq=5)
        await raw.xadd(names.stage_out(2), xadd_fields(entry_fields(late)))
        orch = c.service.orchestrator
        await wait_for(lambda: orch.dropped_outputs == 2)
        assert [o.data for o in outs] == ["wav:HI", "wav:THERE"]
        assert orch.request_states == {}
        await raw.aclose()


async def test_stage_error_ends_only_that_request(
    fake_clients: RedisClients, settings: Settings
) -> None:
    pipeline = seed(final_stage_ids=[2])
    pipeline.stages[1].options["fail_word"] = "boom"
    async with InProcessCluster(pipeline, settings, fake_clients) as c:
        bad, good = await asyncio.gather(c.run("x boom"), c.run("fine"))
    assert len(bad) == 1 and bad[0].finished and bad[0].stage_id == 1
    assert bad[0].error is not None and "stage 1" in bad[0].error and "boom" in bad[0].error
    assert triples(good) == [(2, "wav:FINE", True)]


async def test_malformed_entries_are_dead_lettered_and_acknowledged(
    fake_clients: RedisClients, settings: Settings
) -> None:
    names = settings.names
    async with InProcessCluster(seed(), settings, fake_clients) as c:
        raw = fake_clients.aio()
        garbage = {keys.PAYLOAD_FIELD: b"\xc1not msgpack"}
        wrong_type = {keys.PAYLOAD_FIELD: codec.encode({"type": "stage_output", "v": 1})}
        await raw.xadd(names.requests, xadd_fields(garbage))
        await raw.xadd(names.requests, {"other": b"field"})
        await raw.xadd(names.stage_in(1), xadd_fields(garbage))
        await raw.xadd(names.stage_out(2), xadd_fields(wrong_type))
        counter = fake_clients.sync()
        await wait_for(lambda: counter.xlen(names.dead_letters) >= 4)
        counter.close()
        # everything still works afterwards
        outs = await c.run("still alive")
        assert outs[-1].data == "wav:ALIVE" and outs[-1].finished
        for stream, group in (
            (names.requests, keys.ORCHESTRATOR_GROUP),
            (names.stage_in(1), keys.WORKERS_GROUP),
            (names.stage_out(2), keys.ORCHESTRATOR_GROUP),
        ):
            pending = await raw.xpending(stream, group)
            assert pending["pending"] == 0, stream
        metrics = c.service.metrics
        assert metrics.value("omni_malformed_entries_total", stream=names.requests) == 2
        assert metrics.value("omni_malformed_entries_total", stream=names.stage_out(2)) == 1
        assert metrics.value("omni_dead_letters_total", stream=names.stage_out(2)) == 1
        assert sum(w.status()["malformed_inputs"] for w in c.workers) == 1
        await raw.aclose()


async def test_many_concurrent_requests_no_loss_no_duplicate(
    seed_cluster: InProcessCluster,
) -> None:
    prompts = {f"p{i}": f"w{i} x{i}" for i in range(100)}
    results = await asyncio.gather(
        *(seed_cluster.run(p, request_id=rid) for rid, p in prompts.items())
    )
    for (rid, prompt), outs in zip(prompts.items(), results, strict=True):
        a, b = prompt.split()
        assert triples(outs) == [
            (0, a, False),
            (0, b, False),
            (2, f"wav:{a.upper()}", False),
            (2, f"wav:{b.upper()}", True),
        ], rid


def omni_fast(mode: str) -> PipelineConfig:
    pipeline = load_pipeline(WORKERS / "omni.yaml", mode=mode)
    pipeline.stages[0].options["token_delay_ms"] = 0
    pipeline.stages[1].options["code_delay_ms"] = 0
    return pipeline


async def test_streaming_mode_over_redis_matches_sequential(
    server: fakeredis.FakeServer, settings: Settings
) -> None:
    results = {}
    for mode in ("sequential", "streaming"):
        clients = RedisClients(
            sync=lambda: fakeredis.FakeRedis(server=server),
            aio=lambda: fakeredis.FakeAsyncRedis(server=server),
        )
        ns = settings.model_copy(update={"namespace": mode})
        async with InProcessCluster(omni_fast(mode), ns, clients) as c:
            results[mode] = await c.run("Hello, streaming world!")
    seq, stream = results["sequential"], results["streaming"]
    assert [o.data for o in seq if o.stage_id == 0] == ["Hello", ",", "streaming", "world", "!"]
    assert [o.data for o in stream if o.stage_id == 0] == [o.data for o in seq if o.stage_id == 0]
    audio = [(o.data.tobytes(), o.finished) for o in seq if o.stage_id == 2]
    assert [(o.data.tobytes(), o.finished) for o in stream if o.stage_id == 2] == audio


async def test_abort_reaches_the_workers_and_ends_the_request_once(
    fake_clients: RedisClients, settings: Settings
) -> None:
    pipeline = omni_fast("streaming")
    pipeline.stages[0].options["token_delay_ms"] = 50  # slow enough to abort mid-way
    async with InProcessCluster(pipeline, settings, fake_clients) as c:
        rid = await c.client.submit("one two three four five six seven eight nine ten")
        outs = []
        async for out in c.client.stream(rid):
            outs.append(out)
            if len(outs) == 1:
                await c.client.abort(rid)
        assert outs[-1].finished and outs[-1].error == "aborted"
        assert sum(o.finished for o in outs) == 1
        await wait_for(lambda: all(not w.active for w in c.workers))
        assert sum(w.status()["aborted"] for w in c.workers) >= 1


async def test_deadline_ends_a_slow_request(fake_clients: RedisClients, settings: Settings) -> None:
    pipeline = omni_fast("sequential")
    pipeline.stages[0].options["token_delay_ms"] = 200
    async with InProcessCluster(pipeline, settings, fake_clients) as c:
        outs = await c.run("a b c d e f g h", deadline_s=0.3)
        assert outs[-1].finished and outs[-1].error == "deadline exceeded"
        await wait_for(lambda: all(not w.active for w in c.workers))


async def test_a_stage_whose_upstream_goes_silent_fails_the_request_after_the_input_timeout(
    fake_clients: RedisClients, settings: Settings
) -> None:
    pipeline = omni_fast("streaming")
    pipeline.stages[0].options["token_delay_ms"] = 3_000  # silent for longer than the timeout
    quick = settings.model_copy(update={"input_timeout_s": 0.5})
    async with InProcessCluster(pipeline, quick, fake_clients) as c:
        outs = await c.run("never spoken")
        assert len(outs) == 1 and outs[0].finished
        # stage 1 (upstream silent) or stage 2 (its upstream waits too) gives up first
        assert outs[0].error is not None
        assert re.search(r"no input from stage [01] within 0\.5s", outs[0].error), outs[0].error


@pytest.mark.timeout(120)  # each step below has its own, shorter deadline
async def test_requests_of_a_client_that_vanished_are_aborted(
    fake_clients: RedisClients, settings: Settings
) -> None:
    from omni_runtime.client.client import OmniClient

    pipeline = omni_fast("sequential")
    pipeline.stages[0].options["token_delay_ms"] = 100
    settings = settings.model_copy(update={"heartbeat_ttl_s": 2.0})
    async with InProcessCluster(pipeline, settings, fake_clients) as c:
        ghost = OmniClient(settings, fake_clients)
        async with asyncio.timeout(20):
            await ghost.__aenter__()
            # ~90 s of thinking: it cannot end by itself before the abort is due
            rid = await ghost.submit(" ".join(["word"] * 900))
        await wait_for(lambda: bool(c.workers[0].active))
        # the process "dies": its tasks stop, nothing is closed or aborted politely
        tasks = [ghost._reader, ghost._writer_task]
        assert not await cancel_and_wait([t for t in tasks if t is not None], timeout_s=10)
        orch = c.service.orchestrator
        # its key expires one TTL (2 s) after its last beat; it is gone one TTL after that
        # (~4 s; the deadline leaves room for a 2-core machine under load)
        await wait_for(lambda: rid not in orch.request_states, deadline_s=40)
        await wait_for(lambda: not c.workers[0].active)
        assert c.workers[0].status()["aborted"] == 1
        await ghost.redis.aclose()


async def test_an_output_that_cannot_travel_fails_its_request_not_the_worker(
    fake_clients: RedisClients, settings: Settings
) -> None:
    from omni_runtime.pipeline import PipelineConfig, StageConfig

    pipeline = PipelineConfig(
        name="odd",
        final_stage_ids=[0],
        stages=[StageConfig(id=0, name="odd", entry="tests.odd_stages:emits_a_set")],
    )
    async with InProcessCluster(pipeline, settings, fake_clients) as c:
        outs = await c.run("x")
        assert [(o.data, o.finished) for o in outs] == [("fine", False), (None, True)]
        assert outs[-1].error is not None and "output cannot be sent" in outs[-1].error
        assert "set" in outs[-1].error
        await wait_for(lambda: not c.workers[0].active)


async def test_a_prompt_over_the_size_limit_is_refused_before_sending(
    fake_clients: RedisClients, settings: Settings
) -> None:
    from omni_runtime.client.client import OmniClient
    from omni_runtime.errors import CodecError

    small = settings.model_copy(update={"max_message_bytes": 1024})
    async with OmniClient(small, fake_clients) as client:
        with pytest.raises(CodecError, match="OMNI_MAX_MESSAGE_BYTES"):
            await client.submit("x" * 2000)


async def test_requests_a_crashed_orchestrator_had_read_are_served_by_the_next_one(
    fake_clients: RedisClients, settings: Settings
) -> None:
    """Read from the group but never acknowledged (the orchestrator died): not lost."""
    from omni_runtime.client.client import OmniClient
    from omni_runtime.redis_io.streams import ensure_group
    from omni_runtime.wire.messages import RequestMsg

    names = settings.names
    raw = fake_clients.aio()
    async with OmniClient(settings, fake_clients) as client:
        await ensure_group(raw, names.requests, keys.ORCHESTRATOR_GROUP)
        client.inbox.open("orphan")  # as `submit` registers it, without sending
        msg = RequestMsg(request_id="orphan", client_id=client.client_id, prompt="still here")
        await raw.xadd(names.requests, xadd_fields(entry_fields(msg)))
        # the previous orchestrator's last act: it read the entry, then died
        taken = await raw.xreadgroup(keys.ORCHESTRATOR_GROUP, "orchestrator", {names.requests: ">"})
        assert stream_reply(taken)[0][1]
        async with InProcessCluster(seed(), settings, fake_clients) as c:
            outs = [o async for o in client.stream("orphan", timeout_s=30)]
            assert [o.data for o in outs] == ["still", "here", "wav:STILL", "wav:HERE"]
            await wait_for(lambda: c.service.orchestrator.request_states == {})
        pending = await raw.xpending(names.requests, keys.ORCHESTRATOR_GROUP)
        assert pending["pending"] == 0
    await raw.aclose()
