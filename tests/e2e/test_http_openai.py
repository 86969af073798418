"""The official `openai` package against `omni-runtime serve` in front of real processes."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import uuid
import wave
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soxr
from prometheus_client.parser import text_string_to_metric_families

from omni_runtime.local.launcher import ProcessGroup, child_env
from omni_runtime.pipeline import load_pipeline
from tests.e2e.serving import ROOT, ServeProcess

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]

OMNI = ROOT / "workers" / "omni.yaml"
KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def server(
    redis_server_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    """Workers and orchestrator from the launcher, and serve connecting to the same Redis
    (a namespace of its own: the module shares one deployment)."""
    redis_url = redis_server_url
    tmp_path = tmp_path_factory.mktemp("serve")
    namespace = f"h{uuid.uuid4().hex[:8]}"
    env = child_env(redis_url, {"OMNI_NAMESPACE": namespace})
    group = ProcessGroup(OMNI, load_pipeline(OMNI), env)
    group.start()
    args = ("--pipeline", str(OMNI), "--redis-url", redis_url, "--namespace", namespace)
    try:
        with ServeProcess(tmp_path / "serve.log", *args, env={"OMNI_API_KEYS": KEY}) as serve:
            yield serve
    finally:
        group.stop()


def read_wav(data: bytes) -> tuple[tuple[int, int, int], bytes]:
    with wave.open(io.BytesIO(data)) as w:
        return (w.getnchannels(), w.getsampwidth(), w.getframerate()), w.readframes(1 << 30)


def audio_data(audio: Any) -> str | None:
    if isinstance(audio, dict):
        return audio.get("data")
    return getattr(audio, "data", None)


@pytest.fixture
def connect(server: ServeProcess) -> Iterator[Callable[..., openai.OpenAI]]:
    """`openai.OpenAI` clients of the server, closed after the test (their pooled
    connections are not left to the collector, which warns in whichever test it runs)."""
    made: list[openai.OpenAI] = []

    def connect(api_key: str = KEY) -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0))
        return made[-1]

    yield connect
    for client in made:
        client.close()


def test_openai_client_streams_text_and_audio_and_speech(
    connect: Callable[..., openai.OpenAI],
) -> None:
    client = connect()
    assert [m.id for m in client.models.list()] == ["omni"]

    stream = client.chat.completions.create(
        model="omni",
        messages=[{"role": "user", "content": "Hello, world!"}],
        modalities=["text", "audio"],
        audio={"format": "wav", "voice": "x"},
        stream=True,
    )
    text, pcm, kinds = [], [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.content:
            text.append(delta.content)
            kinds.append("text")
        data = audio_data(getattr(delta, "audio", None))  # typed in openai>=2, extra before
        if data:
            pcm.append(base64.b64decode(data))
            kinds.append("audio")
    assert "".join(text) == "Hello , world !"
    assert kinds.index("audio") > 0  # streamed as produced: text first in sequential mode
    assert len(pcm) >= 4 and all(len(p) > 0 and len(p) % 2 == 0 for p in pcm)
    streamed = b"".join(pcm)  # pcm16: 24 kHz, as an OpenAI client plays it

    whole = client.chat.completions.create(
        model="omni",
        messages=[{"role": "user", "content": "Hello, world!"}],
        modalities=["text", "audio"],
        audio={"format": "wav", "voice": "x"},
    )
    assert whole.choices[0].message.content == "Hello , world !"
    assert whole.choices[0].message.audio is not None
    params, frames = read_wav(base64.b64decode(whole.choices[0].message.audio.data))
    assert params == (1, 2, 16000)
    assert_same_audio(streamed, frames)

    speech = client.audio.speech.create(
        model="omni", input="Hello, world!", voice="alloy", response_format="wav"
    )
    params, speech_frames = read_wav(speech.content)
    assert params == (1, 2, 16000)
    assert speech_frames == frames


def assert_same_audio(pcm24k: bytes, pcm16k: bytes) -> None:
    """The same audio: the 16 kHz one resampled to 24 kHz is within 3 LSB of the other."""
    low = np.frombuffer(pcm16k, "<i2").astype(np.float32) / 32767
    expected = np.round(soxr.resample(low, 16000, 24000, quality="HQ") * 32767)
    got = np.frombuffer(pcm24k, "<i2").astype(np.float32)
    assert len(got) == len(expected)
    assert np.abs(got - expected).max() <= 3


def test_openai_client_errors(connect: Callable[..., openai.OpenAI]) -> None:
    with pytest.raises(openai.AuthenticationError):
        connect("wrong-key-000").models.list()
    client = connect()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="omni", messages=[])
    assert info.value.param == "messages"


def test_serve_exports_its_metrics_without_a_key(
    server: ServeProcess, connect: Callable[..., openai.OpenAI]
) -> None:
    client = connect()
    client.audio.speech.create(model="omni", input="Hi", voice="alloy", response_format="wav")
    resp = httpx.get(f"{server.url}/metrics", timeout=10)
    assert resp.status_code == 200, resp.text
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name in ("omni_time_to_first_token_seconds", "omni_time_to_first_audio_seconds"):
        (count,) = [s for s in families[name].samples if s.name == f"{name}_count"]
        assert count.value >= 1 and count.labels["role"] == "serve"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--pipeline", "workers/omni.yaml", "--host", "0.0.0.0"), "--allow-unauthenticated"),
        (("--pipeline", "workers/seed.yaml"), "no `outputs` field"),
    ],
)
def test_serve_refuses_to_start(args: tuple[str, ...], message: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    proc = subprocess.run(
        [sys.executable, "-m", "omni_runtime.cli", "serve", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
