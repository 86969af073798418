"""Per-request parameters travel with the request and reach every stage, in both modes."""

from __future__ import annotations

from typing import Any

import pytest

from omni_runtime.core.in_memory import InMemoryStage
from omni_runtime.core.orchestrator import Orchestrator, StreamingOrchestrator
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.worker.proc import StageWorker
from tests.cluster import InProcessCluster
from tests.integration.http_support import fake_redis_clients, fast_settings

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
    clients, settings = fake_redis_clients(), fast_settings()
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


TEXT_ONLY = {"modalities": ["text"]}


@pytest.mark.parametrize("orchestrator", [Orchestrator, StreamingOrchestrator])
async def test_a_request_that_wants_no_audio_ends_before_the_audio_stage(
    orchestrator: type[Orchestrator],
) -> None:
    def echo(_rid: str, data: Any) -> list[tuple[Any, bool]]:
        return [(data, True)]

    stages = [InMemoryStage(echo) for _ in range(3)]
    async with orchestrator(stages, final_stage_ids={0, 2}, audio_stage=2) as orch:
        await orch.add_request("text", "p", params=TEXT_ONLY)
        text = await orch.next_output(timeout=5)
        await orch.add_request("both", "p", params={"modalities": ["text", "audio"]})
        both = [await orch.next_output(timeout=5) for _ in range(2)]
    assert (text.request_id, text.stage_id, text.finished, text.error) == ("text", 0, True, None)
    assert [s.params.keys() for s in stages] == [{"text", "both"}, {"both"}, {"both"}]
    assert sorted(o.stage_id for o in both) == [0, 2] and [o.finished for o in both] == [0, 1]
    assert not orch.request_states and orch.dropped_outputs == 0


def speaking_pipeline(mode: str) -> PipelineConfig:
    """Text (stage 0) and a later final stage the file calls its audio."""
    return PipelineConfig.model_validate(
        {
            "name": "speaks",
            "mode": mode,
            "final_stage_ids": [0, 2],
            "stages": [
                {"id": 0, "name": "tag", "entry": "tests.param_stages:tag_words"},
                {"id": 1, "name": "suffix", "entry": "tests.param_stages:SuffixEngine"},
                {"id": 2, "name": "voice", "entry": "tests.param_stages:SuffixEngine"},
            ],
            "outputs": {"text_stage": 0, "audio_stage": 2},
        }
    )


@pytest.mark.parametrize("mode", ["sequential", "streaming"])
async def test_stages_past_the_text_are_not_run_for_a_text_only_request(mode: str) -> None:
    """Over Redis, with the real workers: a text-only request never reaches the stages
    after its text (no input, no chunk sent them), and a spoken one still does."""
    clients, settings = fake_redis_clients(), fast_settings()
    async with InProcessCluster(speaking_pipeline(mode), settings, clients) as cluster:
        text = await cluster.run("one two", params={**TEXT_ONLY, "tag": "A"})
        inputs = [completed(w) for w in cluster.workers]
        sent = chunks_sent(cluster.workers[0])
        spoken = await cluster.run("three", params={"tag": "B", "suffix": "!"})
        spoken_inputs = [completed(w) for w in cluster.workers]
        first_only = await cluster.run("four", params={"final_stages": [0]})
        refused = await cluster.run("five", params={"final_stages": [1]})
        last_inputs = [completed(w) for w in cluster.workers]
    assert [(o.stage_id, o.data, o.finished, o.error) for o in text][-1][2:] == (True, None)
    assert "".join(str(o.data or "") for o in text) == "one/Atwo/A"
    assert {o.stage_id for o in text} == {0}
    assert inputs == [1, 0, 0] and sent == 0
    assert (spoken[-1].stage_id, spoken[-1].error) == (2, None) and "three/B!" in str(
        spoken[-1].data
    )
    assert spoken_inputs == [2, 1, 1]
    assert chunks_sent(cluster.workers[0]) == (1 if mode == "streaming" else 0)
    assert [(o.stage_id, o.data, o.finished) for o in first_only][-1][::2] == (0, True)
    assert [o.error for o in refused] == [
        "invalid request: final_stages must list some of the final stages [0, 2], not [1]"
    ]
    assert last_inputs == [3, 1, 1]


def chunks_sent(worker: StageWorker) -> float:
    return worker.metrics.value("omni_chunks_sent_total", stage=worker.stage_id)


def completed(worker: StageWorker) -> float:
    return worker.metrics.value("omni_requests_completed_total", stage=str(worker.stage_id))
