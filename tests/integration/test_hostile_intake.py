"""Hostile requests at the orchestrator's door (service, workers and clients on one fakeredis):
each is answered with one error final or dead-lettered, and the slot serves on. Entries
are written as any writer could, past the client's own checks (`tests.hostile.raw`)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any, cast

import fakeredis
import pytest

from omni_runtime import keys
from omni_runtime.client.client import OmniClient
from omni_runtime.core.types import OrchOutput
from omni_runtime.errors import CodecError
from omni_runtime.pipeline import PipelineConfig, load_pipeline
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings
from tests.cluster import InProcessCluster
from tests.hostile import Deep, materialized, raw
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

WORKERS = Path(__file__).resolve().parents[2] / "workers"
SEED_AB = [(0, "a"), (0, "b"), (2, "wav:A"), (2, "wav:B")]


@pytest.fixture
def fake_clients() -> RedisClients:
    server = fakeredis.FakeServer()
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
        max_deadline_s=900,
    )


def seed() -> PipelineConfig:
    return load_pipeline(WORKERS / "seed.yaml")


Fields = dict[Any, Any]
"""An entry's fields as redis-py takes them (its stubs name no bytes-only mapping)."""


def request(rid: str, client: OmniClient, **fields: Any) -> Fields:
    doc = {"type": "request", "request_id": rid, "client_id": client.client_id, "prompt": "a b"}
    return {keys.PAYLOAD_FIELD.encode(): raw({**doc, **fields})}


async def answers(client: OmniClient, rid: str) -> list[OrchOutput]:
    return [out async for out in client.stream(rid, timeout_s=20)]


async def dead_letters(c: InProcessCluster) -> list[Fields]:
    return await entries(c, c.settings.names.dead_letters)


async def entries(c: InProcessCluster, stream: str) -> list[Fields]:
    got = cast("list[tuple[bytes, Fields]]", await c.client.redis.xrange(stream))
    return [fields for _id, fields in got]


async def nothing_pending(c: InProcessCluster, stream: str) -> bool:
    info = await c.client.redis.xpending(stream, keys.ORCHESTRATOR_GROUP)
    return int(info["pending"]) == 0


async def exact(c: InProcessCluster) -> None:
    """A good request after the hostile ones: the slot serves on."""
    outs = await c.run("a b")
    assert [(o.stage_id, o.data) for o in outs] == SEED_AB
    assert all(o.error is None for o in outs)


@pytest.mark.parametrize(
    "deadline_s", [math.inf, 1e308, 2**63, math.nan, -1.0, 0, "5", True], ids=repr
)
async def test_a_deadline_no_arithmetic_can_take_is_answered_and_dead_lettered(
    fake_clients: RedisClients, settings: Settings, deadline_s: Any
) -> None:
    """`inf` once made the durable state's expiry raise OverflowError and stopped the slot;
    `2**63` made Redis refuse its PEXPIREAT for ever. Now the entry is refused at the door:
    dead-lettered, and its client told at once why."""
    async with InProcessCluster(seed(), settings, fake_clients) as c:
        c.client.inbox.open("bad")  # as `submit` would, which refuses it itself
        await c.client.redis.xadd(
            c.settings.names.requests, request("bad", c.client, deadline_s=deadline_s)
        )
        (out,) = await answers(c.client, "bad")
        assert out.finished and out.data is None
        assert out.error is not None and out.error.startswith("invalid request: deadline_s: ")
        (dead,) = await dead_letters(c)
        assert dead[b"stream"] == c.settings.names.requests.encode()
        await exact(c)
        await wait_for_nothing_pending(c)
        with pytest.raises(CodecError, match="invalid request: deadline_s"):
            await c.client.submit("a b", deadline_s=deadline_s)


async def wait_for_nothing_pending(c: InProcessCluster, deadline_s: float = 10.0) -> None:
    """Every stream the orchestrator reads (control included): no entry left pending."""
    names = c.settings.names
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    for stream in (names.requests, names.control, *(names.stage_out(k) for k in range(3))):
        while not await nothing_pending(c, stream):
            assert loop.time() < end, f"entries still pending on {stream}"
            await asyncio.sleep(0.01)


async def test_a_deadline_past_the_deployments_limit_gets_one_error_naming_the_setting(
    fake_clients: RedisClients, settings: Settings
) -> None:
    async with InProcessCluster(seed(), settings, fake_clients) as c:
        c.client.inbox.open("long")
        names = c.settings.names
        await c.client.redis.xadd(names.requests, request("long", c.client, deadline_s=901))
        (out,) = await answers(c.client, "long")
        assert out.error == (
            "deadline_s=901 is longer than the longest allowed, 900 s (OMNI_MAX_DEADLINE_S)"
        )
        assert await dead_letters(c) == []  # valid, only not here: answered, not dead
        with pytest.raises(CodecError, match="OMNI_MAX_DEADLINE_S"):
            await c.client.submit("a b", deadline_s=901)
        outs = await c.run("a b", deadline_s=900)
        assert [(o.stage_id, o.data) for o in outs] == SEED_AB
        refused = c.service.metrics.value("omni_requests_refused_total", reason="deadline too long")
        assert refused == 1


@pytest.mark.parametrize("depth", [64, 1000, 100_000])
async def test_a_prompt_nested_too_deep_is_dead_lettered_and_harms_nothing(
    fake_clients: RedisClients, settings: Settings, depth: int
) -> None:
    """Once a bare RecursionError in the decoder stopped the slot's request reader."""
    async with InProcessCluster(seed(), settings, fake_clients) as c:
        await c.client.redis.xadd(
            c.settings.names.requests, request("deep", c.client, prompt=Deep(depth))
        )
        await wait_for(lambda: malformed(c) == 1)
        (dead,) = await dead_letters(c)
        assert b"nested deeper than 64 levels" in dead[b"error"]
        await exact(c)
        if depth <= 1000:
            with pytest.raises(CodecError, match="nested deeper than 64 levels"):
                await c.client.submit(materialized(Deep(depth)))


def malformed(c: InProcessCluster) -> float:
    return c.service.metrics.value("omni_malformed_entries_total", stream=c.settings.names.requests)


@pytest.mark.parametrize(
    "fields",
    [
        {"params": {"voice": {"nested": "map"}}},
        {"params": {"k" * 65: 1}},
        {"params": {f"k{i}": i for i in range(33)}},
        {"params": {"t": math.inf}},
        {"trace": 1},
        {"prompt": "a b", "extra": 1},
        {"v": True},
    ],
    ids=["param-map", "param-key", "params-33", "param-inf", "trace-1", "extra", "v-true"],
)
async def test_an_invalid_request_that_names_its_client_is_answered_and_dead_lettered(
    fake_clients: RedisClients, settings: Settings, fields: dict[str, Any]
) -> None:
    async with InProcessCluster(seed(), settings, fake_clients) as c:
        c.client.inbox.open("bad")
        await c.client.redis.xadd(c.settings.names.requests, request("bad", c.client, **fields))
        (out,) = await answers(c.client, "bad")
        assert out.finished and (out.error or "").startswith("invalid request: ")
        assert len(await dead_letters(c)) == 1
        await exact(c)


async def test_a_live_id_reused_is_refused_unless_the_same_client_sent_the_same_request(
    fake_clients: RedisClients, settings: Settings
) -> None:
    """Read in one batch (one MULTI): the first of each id runs; the same client's identical
    entry (a write retried after its reply was lost) is dropped; another client's, or the
    same client's with another prompt, gets one error final."""
    async with (
        InProcessCluster(seed(), settings, fake_clients) as c,
        OmniClient(settings, fake_clients) as other,
    ):
        a = c.client
        for client, rid in ((a, "r1"), (other, "r1"), (a, "r2")):
            client.inbox.open(rid)
        async with a.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(c.settings.names.requests, request("r1", a))
            pipe.xadd(c.settings.names.requests, request("r1", other, prompt="x"))
            pipe.xadd(c.settings.names.requests, request("r1", a))  # a retransmission
            pipe.xadd(c.settings.names.requests, request("r2", a, prompt="b a"))
            pipe.xadd(c.settings.names.requests, request("r2", a, prompt="other"))
            await pipe.execute()
        r1 = await answers(a, "r1")
        assert [(o.stage_id, o.data) for o in r1] == SEED_AB and r1[-1].finished
        (refused,) = await answers(other, "r1")
        assert refused.error == "duplicate request id: request 'r1' is in flight already"
        (r2,) = await answers(a, "r2")  # its refusal is the first output a reads for it
        assert r2.error == "duplicate request id: request 'r2' is in flight already"
        count = c.service.metrics.value(
            "omni_requests_refused_total", reason="duplicate request id"
        )
        assert count == 2
        await wait_for(lambda: not c.service.orchestrator.request_states)
        await wait_for_nothing_pending(c)
        assert await dead_letters(c) == []


async def test_malformed_control_entries_are_dead_lettered_and_good_ones_acknowledged(
    fake_clients: RedisClients, settings: Settings
) -> None:
    """The control stream is a broadcast the workers XREAD: the orchestrators' group on it
    dead-letters what is malformed (once, whatever the number of workers)."""
    async with InProcessCluster(seed(), settings, fake_clients) as c:
        control = c.settings.names.control
        bad: list[Fields] = [
            {b"m": b"\xc1 not msgpack"},
            {b"m": raw({"type": "abort", "request_id": "x", "reason": ""})},
            {b"m": raw({"type": "abort", "request_id": 5})},
            {b"other": b"field"},
        ]
        good = {b"m": raw({"type": "abort", "request_id": "nobody"})}
        for fields in [*bad, good]:
            await c.client.redis.xadd(control, fields)
        await wait_for(lambda: dead_in(c) == len(bad))
        dead = await dead_letters(c)
        assert [d[b"stream"] for d in dead] == [control.encode()] * len(bad)
        await wait_for_nothing_pending(c)
        assert await entries(c, control) == [good]  # the workers' to read
        await exact(c)


def dead_in(c: InProcessCluster) -> float:
    return c.service.metrics.value("omni_dead_letters_total", stream=c.settings.names.control)
