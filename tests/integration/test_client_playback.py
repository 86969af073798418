"""The client measures playback gaps of the pipeline's audio stage, over fakeredis."""

from __future__ import annotations

import asyncio

import fakeredis
import numpy as np
import pytest

from omni_runtime.client.client import OmniClient
from omni_runtime.pipeline import OutputsConfig
from omni_runtime.redis_io.clients import RedisClients
from tests.integration.test_client_sequence import out, send, settings

pytestmark = pytest.mark.timeout(60)

RATE = 16000
AUDIO = OutputsConfig(text_stage=0, audio_stage=2, sample_rate=RATE)


@pytest.fixture
def fake_clients() -> RedisClients:
    server = fakeredis.FakeServer()
    return RedisClients(
        sync=lambda: fakeredis.FakeRedis(server=server),
        aio=lambda: fakeredis.FakeAsyncRedis(server=server),
    )


def pcm(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * RATE), dtype=np.float32)


async def test_audio_that_arrives_ahead_of_playback_has_no_gap(fake_clients: RedisClients) -> None:
    async with OmniClient(settings(), fake_clients, outputs=AUDIO) as client:
        rid = await client.submit("x")
        await send(client, out(rid, 0, pcm(2.0)), out(rid, 1, pcm(2.0)), out(rid, 2, pcm(0), True))
        assert len([o async for o in client.stream(rid, timeout_s=10)]) == 3
        gaps = client.metrics.histogram("omni_audio_gap_seconds")
        assert gaps.count == 1 and gaps.sum == 0.0


async def test_audio_that_comes_after_the_buffer_ran_dry_is_a_gap(
    fake_clients: RedisClients,
) -> None:
    async with OmniClient(settings(), fake_clients, outputs=AUDIO) as client:
        rid = await client.submit("x")
        stream = client.stream(rid, timeout_s=10)
        await send(client, out(rid, 0, pcm(0.01)))
        first = await anext(stream)
        assert not first.finished
        await asyncio.sleep(0.1)  # 10 ms of audio played out: at least 90 ms of silence follow
        await send(client, out(rid, 1, pcm(0.01), True))
        assert [o.finished async for o in stream] == [True]
        gaps = client.metrics.histogram("omni_audio_gap_seconds")
        assert gaps.count == 1 and gaps.sum >= 0.09


async def test_no_audio_stage_or_an_abandoned_request_observes_nothing(
    fake_clients: RedisClients,
) -> None:
    async with OmniClient(settings(), fake_clients) as client:  # no outputs: nothing to time
        rid = await client.submit("x")
        await send(client, out(rid, 0, pcm(0.01)), out(rid, 1, pcm(0.01), True))
        assert len([o async for o in client.stream(rid, timeout_s=10)]) == 2
        assert client.metrics.histogram("omni_audio_gap_seconds").count == 0
    async with OmniClient(settings(), fake_clients, outputs=AUDIO) as client:
        rid = await client.submit("x")
        await send(client, out(rid, 0, pcm(0.01)))
        async for _o in client.stream(rid, timeout_s=10):
            break  # the listener left before the end: no complete playback to judge
        assert client.metrics.histogram("omni_audio_gap_seconds").count == 0
