"""Background responses on a real Redis Cluster: a response's lease, end, events and the
response kept fall in different slots, each read and written alone (the in-process
deployment and front door of the HTTP tests, on the cluster)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from omni_runtime.redis_io.clients import RedisClients
from tests.integration.http_support import fast_settings, omni, serving
from tests.integration.test_http_background import LONG, SHORT, ended
from tests.integration.test_http_responses import sdk

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]


async def test_background_responses_run_cancel_and_stream_again_on_a_cluster(
    redis_cluster_url: str,
) -> None:
    clients = RedisClients.from_url(redis_cluster_url)
    assert clients.cluster
    settings = fast_settings().model_copy(
        update={"redis_url": redis_cluster_url, "namespace": f"bg{uuid.uuid4().hex[:8]}"}
    )
    async with serving([omni(token_delay_ms=20)], clients, settings) as (client, gateway):
        stream = await sdk(client).responses.create(
            model="omni", input=SHORT, background=True, stream=True
        )
        events: list[Any] = [ev async for ev in stream]
        assert events[-1].type == "response.completed", events[-1]
        response_id = events[0].response.id
        again = sdk(client).responses.retrieve(response_id, stream=True, starting_after=3)
        rest: list[Any] = [ev async for ev in await again]
        assert [ev.sequence_number for ev in rest] == list(range(4, len(events)))
        long = await sdk(client).responses.create(model="omni", input=LONG, background=True)
        cancelled = await sdk(client).responses.cancel(long.id)
        assert cancelled.status == "cancelled"
        assert (await ended(client, long.id))["status"] == "cancelled"
        assert gateway.metrics.value("omni_background_events_unkept_total") == 0
