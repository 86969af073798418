"""The speech pipelines docs/engines.md shows, run through the runtime: workers, orchestrator
and client in one process on fakeredis, in both modes."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import fakeredis
import numpy as np
import pytest
import yaml

from omni_runtime.core.types import OrchOutput
from omni_runtime.engines.wer import wer
from omni_runtime.pipeline import PipelineConfig, resolve_entry
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings
from tests.cluster import InProcessCluster
from tests.engines.speech import MAX_WER, SENTENCES, audio

pytestmark = pytest.mark.timeout(180)
DOC = Path(__file__).resolve().parents[2] / "docs" / "engines.md"
PIPELINES = {
    p["name"]: p
    for p in (yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S))
}


def pipeline(name: str, mode: str) -> PipelineConfig:
    return PipelineConfig.model_validate({**PIPELINES[name], "mode": mode})


@pytest.fixture
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[InProcessCluster]:
    name, mode = request.param
    server = fakeredis.FakeServer()
    clients = RedisClients(
        sync=lambda: fakeredis.FakeRedis(server=server),
        aio=lambda: fakeredis.FakeAsyncRedis(server=server),
    )
    settings = Settings(
        redis_url="redis://unused", block_ms=20, orchestrator_idle_block_ms=20,
        heartbeat_interval_s=0.2,
    )  # fmt: skip
    async with InProcessCluster(pipeline(name, mode), settings, clients) as c:
        yield c


def of_stage(outs: list[OrchOutput], stage_id: int) -> list[Any]:
    """One final stage's chunks, from a request that ended well (its last output, only)."""
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    return [o.data for o in outs if o.stage_id == stage_id]


def test_every_pipeline_in_the_doc_is_valid_and_its_entries_resolve() -> None:
    assert {"piper-speech", "smollm2-piper", "espeak-speech", "echo-voice"} <= set(PIPELINES)
    for name in PIPELINES:
        config = pipeline(name, "streaming")
        for stage in config.stages:
            assert callable(resolve_entry(stage.entry, None)), stage.entry


BOTH_MODES = ["sequential", "streaming"]


@pytest.mark.usefixtures("needs_piper", "needs_pocketsphinx")
@pytest.mark.parametrize("cluster", [("piper-speech", m) for m in BOTH_MODES], indirect=True)
async def test_piper_speaks_the_prompt_and_a_request_picks_its_voice(
    cluster: InProcessCluster,
) -> None:
    from omni_runtime.engines.pocketsphinx import transcribe

    chunks = of_stage(await cluster.run(SENTENCES, params={"speed": 1.2}), 1)
    assert all(isinstance(c, np.ndarray) and c.dtype == np.float32 for c in chunks)
    heard = transcribe({"pcm": audio(chunks), "sample_rate": 22_050})
    assert wer(SENTENCES, heard) <= MAX_WER, heard
    refused = await cluster.run("Hello.", params={"voice": "nobody"})
    assert [o.finished for o in refused] == [True]
    assert "unknown voice or speaker 'nobody'" in str(refused[0].error)


@pytest.mark.usefixtures("needs_espeak")
@pytest.mark.parametrize("cluster", [("espeak-speech", "streaming")], indirect=True)
async def test_espeak_streams_the_prompt_in_pieces(cluster: InProcessCluster) -> None:
    chunks = of_stage(await cluster.run(SENTENCES, params={"voice": "alloy"}), 0)
    assert len(chunks) > 50 and 5.0 < audio(chunks).size / 22_050 < 15.0


@pytest.mark.usefixtures("needs_piper", "needs_pocketsphinx")
@pytest.mark.parametrize("cluster", [("echo-voice", m) for m in BOTH_MODES], indirect=True)
async def test_speech_in_is_heard_and_said_back(cluster: InProcessCluster) -> None:
    from omni_runtime.engines import piper
    from tests.engines.speech import unwrap

    spoken = audio(unwrap(piper.vocoder(unwrap(piper.talker(SENTENCES)))))
    outs = await cluster.run({"pcm": spoken, "sample_rate": 22_050})
    (heard,) = of_stage(outs, 0)
    assert wer(SENTENCES, heard) <= MAX_WER, heard
    assert audio(of_stage(outs, 2)).size > 22_050 * 3
