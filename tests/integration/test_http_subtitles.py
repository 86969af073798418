"""`/v1/audio/transcriptions` as `verbose_json`, `srt` and `vtt`, over the HTTP path (an
in-process cluster per pipeline on fakeredis): a stage that times its words
(`tests.http_stages:wav_words`), and one that gives plain text."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from omni_runtime.http.app import create_app
from omni_runtime.http.audio import b64
from omni_runtime.http.gateway import Gateway
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.worker.proc import StageWorker
from tests.cluster import InProcessCluster
from tests.integration.http_support import (
    CHAT,
    assert_error,
    fake_redis_clients,
    fast_settings,
    gateway_for,
    http,
    pipeline_of,
    serving,
    wav_file,
)

TRANSCRIBE = "/v1/audio/transcriptions"


@pytest.fixture
async def api() -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    clients: RedisClients = fake_redis_clients()
    pipelines = [pipeline_of("timed"), pipeline_of("transcribe")]
    async with serving(pipelines, clients, fast_settings(), max_upload_bytes=640_000) as served:
        yield served


async def test_verbose_json_has_the_segments_and_words_asked_for(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, gateway = api
    form = {"model": "timed", "response_format": "verbose_json", "language": "en"}
    wav = {"file": ("a.wav", wav_file(4.0))}  # 8 words, two pieces of four
    resp = await client.post(TRANSCRIBE, data=form, files=wav)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["text"] == "w0 w1 w2 w3 w4 w5 w6 w7"
    assert body["duration"] == 4.0 and body["language"] == "en" and body["task"] == "transcribe"
    assert body["segments"] == [
        {"id": 0, "start": 0.0, "end": 1.9, "text": "w0 w1 w2 w3"},
        {"id": 1, "start": 2.0, "end": 3.9, "text": " w4 w5 w6 w7"},
    ]
    assert "words" not in body  # segments only, unless asked
    words = {"timestamp_granularities[]": ["word"]}
    resp = await client.post(TRANSCRIBE, data=form | words, files=wav)
    body = resp.json()
    assert "segments" not in body
    assert body["words"][:2] == [
        {"word": "w0", "start": 0.0, "end": 0.4},
        {"word": "w1", "start": 0.5, "end": 0.9},
    ]
    assert len(body["words"]) == 8
    both = {"timestamp_granularities[]": ["word", "segment"]}
    body = (await client.post(TRANSCRIBE, data=form | both, files=wav)).json()
    assert len(body["segments"]) == 2 and len(body["words"]) == 8
    assert gateway.inflight == 0


async def test_srt_and_vtt_are_cues_cut_where_the_speaker_pauses(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    """`wav_words` pauses 0.1 s between words: less than a cue's pause, so a cue ends at its
    piece's end; 12 words."""
    client, _gateway = api
    wav = {"file": ("a.wav", wav_file(6.0))}
    srt = await client.post(
        TRANSCRIBE, data={"model": "timed", "response_format": "srt"}, files=wav
    )
    assert srt.status_code == 200, srt.text
    assert srt.headers["content-type"].startswith("application/x-subrip")
    assert srt.text == (
        "1\n00:00:00,000 --> 00:00:01,900\nw0 w1 w2 w3\n\n"
        "2\n00:00:02,000 --> 00:00:03,900\nw4 w5 w6 w7\n\n"
        "3\n00:00:04,000 --> 00:00:05,900\nw8 w9 w10 w11\n"
    )
    vtt = await client.post(
        TRANSCRIBE, data={"model": "timed", "response_format": "vtt"}, files=wav
    )
    assert vtt.headers["content-type"].startswith("text/vtt")
    assert vtt.text.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.900\nw0 w1 w2 w3\n\n")


async def test_a_stage_that_gives_plain_text_is_one_segment_over_the_recording(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    wav = {"file": ("a.wav", wav_file(1.25))}
    form = {"model": "transcribe", "response_format": "verbose_json"}
    body = (await client.post(TRANSCRIBE, data=form, files=wav)).json()
    text = "1.2500 s, 16000 Hz, 1 ch, language -"
    assert body["segments"] == [{"id": 0, "start": 0.0, "end": 1.25, "text": text}]
    words = form | {"timestamp_granularities[]": ["word"]}
    assert (await client.post(TRANSCRIBE, data=words, files=wav)).json()["words"] == []
    srt = await client.post(
        TRANSCRIBE, data={"model": "transcribe", "response_format": "srt"}, files=wav
    )
    assert srt.text == f"1\n00:00:00,000 --> 00:00:01,250\n{text}\n"


@pytest.mark.parametrize(
    ("form", "param"),
    [
        ({"response_format": "json", "timestamp_granularities[]": "word"},
         "timestamp_granularities"),
        ({"response_format": "verbose_json", "timestamp_granularities[]": "letter"},
         "timestamp_granularities[].0"),
        ({"response_format": "srt", "stream": "true"}, "stream"),
        ({"response_format": "tsv"}, "response_format"),
    ],
    ids=["words-without-verbose-json", "unknown-granularity", "streamed-srt", "tsv"],
)  # fmt: skip
async def test_timed_forms_asked_wrongly_are_openai_errors(
    api: tuple[httpx.AsyncClient, Gateway], form: dict[str, str], param: str
) -> None:
    client, gateway = api
    resp = await client.post(
        TRANSCRIBE, data={"model": "timed"} | form, files={"file": ("a.wav", wav_file(0.5))}
    )
    assert_error(resp, 400, param)
    assert gateway.inflight == 0


def hears_and_answers(mode: str) -> PipelineConfig:
    """Stage 0 hears (final: the user's words), stage 1 answers them (the text stage)."""
    return PipelineConfig.model_validate({
        "name": "hears", "mode": mode, "final_stage_ids": [0, 1],
        "stages": [{"id": 0, "name": "speech_to_text", "entry": "tests.http_stages:wav_duration"},
                   {"id": 1, "name": "parrot", "entry": "tests.http_stages:parrot"}],
        "outputs": {"input": "audio", "text_stage": 1},
    })  # fmt: skip


@pytest.mark.parametrize("mode", ["sequential", "streaming"])
async def test_a_pipeline_that_also_answers_transcribes_with_its_first_stage_alone(
    mode: str,
) -> None:
    """The transcript is what stage 0 heard, not the answer; the answering stage never runs
    for it (`final_stages`), and still answers a chat."""
    async with (
        InProcessCluster(hears_and_answers(mode), fast_settings(), fake_redis_clients()) as c,
        http(create_app(gateway_for(c))) as client,
    ):
        files = {"file": ("a.wav", wav_file(1.25))}
        heard = await client.post(TRANSCRIBE, data={"model": "hears"}, files=files)
        ran = [completed(w) for w in c.workers]
        streamed = await client.post(
            TRANSCRIBE, data={"model": "hears", "stream": "true"}, files=files
        )
        spoken = {
            "type": "input_audio",
            "input_audio": {"data": b64(wav_file(0.5)), "format": "wav"},
        }
        messages = [{"role": "user", "content": [spoken]}]
        answer = await client.post(CHAT, json={"model": "hears", "messages": messages})
    assert heard.status_code == 200, heard.text
    assert heard.json() == {"text": "1.2500 s, 16000 Hz, 1 ch, language -"}
    assert ran == [1, 0]
    assert streamed.status_code == 200 and '"delta":"1.2500 s, 16000 Hz' in streamed.text
    assert answer.status_code == 200, answer.text
    said = answer.json()["choices"][0]["message"]["content"]
    assert said.startswith("You said: 0.5000 s, 16000 Hz"), said
    assert [completed(w) for w in c.workers] == [3, 1]


def completed(worker: StageWorker) -> float:
    return worker.metrics.value("omni_requests_completed_total", stage=str(worker.stage_id))
