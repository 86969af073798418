"""Per-request parameters travel with the request and reach every stage, in both modes."""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest

from omni_runtime.core.in_memory import InMemoryStage
from omni_runtime.core.orchestrator import Orchestrator, StreamingOrchestrator
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings
from tests.cluster import InProcessCluster

pytestmark = pytest.mark.timeout(60)


def pipeline(mode: str) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "name": "params",
            "mode": mode,
            "final_stage_ids": [1],
            "stages": [
                {"id": 0, "name": "tag", "entry": "tests.param_stages:tag_words"},
                {"id": 1, "name": "suffix", "entry": "tests.param_stages:SuffixEngine"},
            ],
        }
    )


@pytest.mark.parametrize("mode", ["sequential", "streaming"])
async def test_each_stage_gets_its_requests_params(mode: str) -> None:
    server = fakeredis.FakeServer()
    clients = RedisClients(
        sync=lambda: fakeredis.FakeRedis(server=server),
        aio=lambda: fakeredis.FakeAsyncRedis(server=server),
    )
    settings = Settings(
        redis_url="redis://unused", block_ms=20, orchestrator_idle_block_ms=20,
        heartbeat_interval_s=0.2,
    )  # fmt: skip
    async with InProcessCluster(pipeline(mode), settings, clients) as cluster:
        a = await cluster.run("one two", params={"tag": "A", "suffix": "!"})
        b = await cluster.run("three", params={"tag": "B", "suffix": "?"})
        plain = await cluster.run("four")
    assert [(o.data, o.error) for o in a] == [(["one/A!", "two/A!"], None)]
    assert [(o.data, o.error) for o in b] == [(["three/B?"], None)]
    assert [(o.data, o.error) for o in plain] == [(["four/-"], None)]


@pytest.mark.parametrize("orchestrator", [Orchestrator, StreamingOrchestrator])
async def test_the_orchestrator_submits_params_with_every_stage_input(
    orchestrator: type[Orchestrator],
) -> None:
    def echo(_rid: str, data: Any) -> list[tuple[Any, bool]]:
        return [(data, True)]

    stages = [InMemoryStage(echo), InMemoryStage(echo)]
    async with orchestrator(stages, final_stage_ids={1}) as orch:
        await orch.add_request("r", "p", params={"voice": "joe"})
        out = await orch.next_output(timeout=5)
    assert out.finished and out.error is None
    assert [s.params for s in stages] == [{"r": {"voice": "joe"}}] * 2
