"""Orchestrator slots over fakeredis: durable request states as they change, and a new
orchestrator resuming exactly what a stopped one left in flight."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import fakeredis
import pytest

from omni_runtime.client.client import OmniClient
from omni_runtime.core.types import OrchOutput
from omni_runtime.orchestrator.proc import OrchestratorService
from omni_runtime.orchestrator.slot import SlotService
from omni_runtime.pipeline import PipelineConfig, load_pipeline
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.streams import GroupReader
from omni_runtime.settings import Settings
from omni_runtime.wire import codec
from omni_runtime.wire.messages import DurableRequest
from omni_runtime.worker.proc import StageWorker
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(90)

WORKERS = Path(__file__).resolve().parents[2] / "workers"
SLOW_MS = 400


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def clients(server: fakeredis.FakeServer) -> RedisClients:
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


def slow_seed(mode: str = "sequential") -> PipelineConfig:
    """The seed pipeline with stage 1 slow, so requests stay in flight a while."""
    p = load_pipeline(WORKERS / "seed.yaml", mode=mode)
    stage1 = p.stages[1].model_copy(update={"options": {"delay_ms": SLOW_MS}})
    return p.model_copy(update={"stages": [p.stages[0], stage1, p.stages[2]]})


class Workers:
    def __init__(self, pipeline: PipelineConfig, settings: Settings, clients: RedisClients):
        self.workers = [
            StageWorker(pipeline, s.id, settings, clients, worker_id=f"w{s.id}")
            for s in pipeline.stages
        ]
        self.threads = [threading.Thread(target=w.run, daemon=True) for w in self.workers]

    def __enter__(self) -> Workers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for w in self.workers:
            w.stop()
        for t in self.threads:
            t.join(10)


async def start(service: OrchestratorService) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.wait_for(service.ready.wait(), 20)
    return stop, task


def expected(prompt: str) -> list[tuple[int, Any, bool]]:
    words = prompt.split()
    return [(0, w, False) for w in words] + [
        (2, f"wav:{w.upper()}", i == len(words) - 1) for i, w in enumerate(words)
    ]


async def collect(client: OmniClient, rid: str) -> list[tuple[int, Any, bool]]:
    outs: list[OrchOutput] = [o async for o in client.stream(rid, timeout_s=20)]
    assert all(o.error is None for o in outs), outs
    return [(o.stage_id, o.data, o.finished) for o in outs]


async def test_a_request_state_follows_the_request_and_goes_with_it(
    settings: Settings, clients: RedisClients
) -> None:
    pipeline = slow_seed()
    names = settings.names
    raw = clients.aio()
    service = OrchestratorService(pipeline, settings, clients)
    with Workers(pipeline, settings, clients):
        stop, task = await start(service)
        async with OmniClient(settings, clients) as client:
            await client.wait_ready([0, 1, 2], timeout_s=20)
            await client.submit("hi there", request_id="r1")
            result = asyncio.create_task(collect(client, "r1"))
            key = names.orchestrator_states(0)
            doc: DurableRequest | None = None
            deadline = time.monotonic() + 20
            while doc is None or 1 not in doc.submitted:  # stage 1 (slow) is running now
                assert time.monotonic() < deadline, "stage 1 never submitted"
                await asyncio.sleep(0.01)
                blob = await raw.hget(key, "r1")
                doc = (
                    None if blob is None else codec.decode_model(cast(bytes, blob), DurableRequest)
                )
            assert doc.client_id == client.client_id and doc.prompt == "hi there"
            assert (doc.submitted, doc.finished) == ([0, 1], [0])
            assert doc.out_seq == 2 and doc.stage_seq == {0: 2}  # stage 0's two outputs
            assert doc.stage_data == {}  # stage 0 was forwarded: nothing left to keep
            assert doc.deadline_at is not None
            assert await raw.hkeys(key) == [b"r1"]
            assert 0 < await raw.pttl(key) <= (doc.deadline_at + 61 - time.time()) * 1000
            assert await result == expected("hi there")
            await wait_for(lambda: service.orchestrator.request_states == {})
            await service.writer.written()
            assert await raw.exists(key) == 0  # the hash went with its last state
        stop.set()
        await task
    await raw.aclose()


@pytest.mark.parametrize("mode", ["sequential", "streaming"])
async def test_a_new_orchestrator_finishes_what_a_stopped_one_left_in_flight(
    settings: Settings, clients: RedisClients, mode: str
) -> None:
    pipeline = slow_seed(mode)
    raw = clients.aio()
    prompts = {f"q{i}": f"a{i} b{i} c{i}" for i in range(6)}
    first = OrchestratorService(pipeline, settings, clients)
    with Workers(pipeline, settings, clients):
        stop, task = await start(first)
        async with OmniClient(settings, clients) as client:
            await client.wait_ready([0, 1, 2], timeout_s=20)
            for rid, prompt in prompts.items():
                await client.submit(prompt, request_id=rid)
            results = {rid: asyncio.create_task(collect(client, rid)) for rid in prompts}
            states = settings.names.orchestrator_states(0)
            deadline = time.monotonic() + 20
            while await raw.hlen(states) < len(prompts):
                assert time.monotonic() < deadline, "not every request was registered"
                await asyncio.sleep(0.01)
            stop.set()  # every request in flight: stage 1 holds them
            await task
            second = OrchestratorService(pipeline, settings, clients)
            stop2, task2 = await start(second)
            assert second.leases.held == {0}  # the slot given back is this one's home
            assert second.home is not None and second.home.restored >= 1
            for rid, prompt in prompts.items():
                assert await results[rid] == expected(prompt), rid
            assert client.dropped_outputs == 0
            await wait_for(lambda: second.orchestrator.request_states == {})
            if mode == "sequential":  # streaming: a stage's end may follow the request's
                assert second.orchestrator.dropped_outputs == 0
            stop2.set()
            await task2
    await raw.aclose()


async def test_a_new_orchestrator_gets_every_chunk_of_a_stage_still_streaming(
    settings: Settings, clients: RedisClients
) -> None:
    """Sequential mode keeps the chunks of the stage running, each in a field of its own:
    stopped mid-stream, the first orchestrator leaves them all to the next one, which
    forwards the whole list (the early chunks exist nowhere else any more)."""
    seed = load_pipeline(WORKERS / "seed.yaml")
    streamer = seed.stages[0].model_copy(
        update={"entry": "workers.omni:thinker", "options": {"token_delay_ms": 40}}
    )
    pipeline = seed.model_copy(
        update={"stages": [streamer, seed.stages[1]], "final_stage_ids": [1]}
    )
    words = [f"w{i}" for i in range(25)]
    raw = clients.aio()
    key = settings.names.orchestrator_states(0)
    first = OrchestratorService(pipeline, settings, clients)
    with Workers(pipeline, settings, clients):
        stop, task = await start(first)
        async with OmniClient(settings, clients) as client:
            await client.wait_ready([0, 1], timeout_s=20)
            await client.submit(" ".join(words), request_id="r1")
            result = asyncio.create_task(collect(client, "r1"))
            deadline = time.monotonic() + 20
            while len(await raw.hkeys(key)) < 4:  # the state and three chunks of stage 0
                assert time.monotonic() < deadline, "stage 0's chunks never kept"
                await asyncio.sleep(0.01)
            stop.set()
            await task
            blob = await raw.hget(key, "r1")
            doc = codec.decode_model(cast(bytes, blob), DurableRequest)
            assert doc.finished == [] and doc.stage_data == {}  # stage 0 still streaming
            kept = doc.stage_chunks[0]
            assert 3 <= kept < len(words) and await raw.hlen(key) == 1 + kept
            second = OrchestratorService(pipeline, settings, clients)
            stop2, task2 = await start(second)
            assert second.home is not None and second.home.restored == 1
            assert await result == [(1, [w.upper() for w in words], True)]
            await wait_for(lambda: second.orchestrator.request_states == {})
            await second.writer.written()
            assert await raw.exists(key) == 0  # the state and its chunks went together
            stop2.set()
            await task2
    await raw.aclose()


async def test_an_idle_slot_reads_long_one_in_flight_short_neither_past_the_fence(
    clients: RedisClients,
) -> None:
    """Reads of a slot with nothing in flight block long (an idle orchestrator wakes
    seldom); with requests in flight, `block_ms`; never past the lease fence."""
    settings = Settings(redis_url="redis://unused", block_ms=20, orchestrator_idle_block_ms=3000)
    service = OrchestratorService(slow_seed(), settings, clients)
    served = SlotService(service.shared, 0, home=True)
    readers: list[GroupReader[Any]] = [served.requests, *(st.reader for st in served.stages)]

    def budgets() -> list[int]:
        return [r.block_budget() for r in readers if r.block_budget is not None]

    assert not service.leases.fresh()
    assert budgets() == [1] * 4  # never kept: the caller's `hold()` waits, a read barely
    assert await service.leases.take(0)
    assert budgets() == [3000] * 4
    served.client_of["r1"] = "c1"
    assert budgets() == [20] * 4
    served.client_of.clear()
    service.shared.settings = replace(service.shared.settings, orchestrator_idle_block_ms=4_000)
    fence_ms = settings.orchestrator_lease_ttl_s * 0.75 * 1000
    assert all(3000 < ms <= fence_ms for ms in budgets())
    await service.client.aclose()
