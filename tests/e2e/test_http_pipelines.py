"""The official `openai` client against one `omni-runtime serve` fronting three pipelines
(an embedded deployment: serve starts Redis and every pipeline's processes): request
parameters reach the stages, a multipart WAV is transcribed, each pipeline is a model."""

from __future__ import annotations

import io
import json
import wave
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from omni_runtime.local.launcher import redis_server_binary
from tests.e2e.serving import ROOT, ServeProcess
from tests.integration.http_support import wav_file
from tests.services import unavailable

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]

PIPELINES = ROOT / "tests" / "pipelines"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    if redis_server_binary() is None:
        unavailable("no redis-server on PATH", "a redis-server")
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    pair = f"{PIPELINES / 'echo.yaml'},{PIPELINES / 'transcribe.yaml'}"  # a comma list
    with ServeProcess(log, "--pipeline", "workers/omni.yaml", "--pipeline", pair) as serve:
        yield serve


@pytest.fixture
def client(server: ServeProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def wav_params(data: bytes) -> tuple[int, int, int, int]:
    """(channels, sample width, rate, frames) of a WAV, streamed or not."""
    with wave.open(io.BytesIO(data)) as w:
        frames = len(w.readframes(1 << 30)) // (w.getnchannels() * w.getsampwidth())
        return w.getnchannels(), w.getsampwidth(), w.getframerate(), frames


def test_every_pipeline_is_a_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["omni", "echo", "transcribe"]
    assert client.models.retrieve("transcribe").id == "transcribe"


def test_chat_parameters_reach_the_stages(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model="echo",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
        ],
        max_completion_tokens=12,
        temperature=0.25,
        top_p=0.5,
        stop=["."],
        seed=11,
        modalities=["text", "audio"],
        audio={"format": "wav", "voice": "high"},
    )
    said = json.loads(whole.choices[0].message.content or "")
    assert said["params"] == {
        "max_tokens": 12,
        "temperature": 0.25,
        "top_p": 0.5,
        "stop": ["."],
        "seed": 11,
        "voice": "high",
    }
    assert said["prompt"] == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
        ]
    }
    stream = client.chat.completions.create(
        model="echo",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    # text alone from a pipeline that speaks: its TTS stages are told to make no audio
    assert json.loads(text)["params"] == {"max_tokens": 3, "modalities": ["text"]}


def test_speech_then_its_transcription(client: openai.OpenAI, tmp_path: Path) -> None:
    speech = client.audio.speech.create(
        model="echo", input="Say this", voice="low", speed=2.0, response_format="wav"
    )
    assert wav_params(speech.content) == (1, 2, 16000, 800)  # 0.1 s at speed 2
    path = tmp_path / "speech.wav"
    path.write_bytes(speech.content)  # its header says "until the end": it was streamed
    with path.open("rb") as f:
        result = client.audio.transcriptions.create(model="transcribe", file=f, language="en")
    assert result.text == "0.0500 s, 16000 Hz, 1 ch, language en"

    omni_speech = client.audio.speech.create(
        model="omni", input="Hello, world!", voice="alloy", response_format="wav"
    )
    frames = wav_params(omni_speech.content)[3]
    as_text = client.audio.transcriptions.create(
        model="transcribe", file=("hello.wav", omni_speech.content), response_format="text"
    )
    assert as_text == f"{frames / 16000:.4f} s, 16000 Hz, 1 ch, language -"


def test_bad_requests_are_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.transcriptions.create(model="transcribe", file=("a.mp3", b"ID3\x03 no wav"))
    assert bad.value.param == "file"
    wav = wav_file(0.01)
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.transcriptions.create(model="echo", file=("a.wav", wav))
    assert bad.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav))
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi"}], temperature=2.5
        )
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.speech.create(model="echo", input="hi", voice="alloy", speed=9)
    assert bad.value.param == "speed"
