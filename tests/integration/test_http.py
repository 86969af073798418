"""The HTTP front end over an in-process cluster on fakeredis: OpenAI shapes, streaming, aborts."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import wave
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile

from omni_runtime.http.app import create_app
from omni_runtime.http.gateway import Gateway
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings
from tests.cluster import InProcessCluster
from tests.integration.http_support import (
    AUDIO_ON,
    CHAT,
    PROMPT,
    PROMPT_TEXT,
    assert_error,
    chat_body,
    expected_pcm,
    fake_redis_clients,
    fast_settings,
    gateway_for,
    http,
    omni,
    sse_events,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake_clients() -> RedisClients:
    return fake_redis_clients()


@pytest.fixture
def settings() -> Settings:
    return fast_settings()


@pytest.fixture
async def cluster(
    fake_clients: RedisClients, settings: Settings
) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(omni(), settings, fake_clients) as c:
        yield c


@pytest.fixture
async def api(cluster: InProcessCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with http(create_app(gateway_for(cluster))) as client:
        yield client


async def test_streaming_chat_interleaves_text_and_audio(
    api: httpx.AsyncClient, cluster: InProcessCluster
) -> None:
    resp = await api.post(CHAT, json=chat_body(stream=True, **AUDIO_ON))
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == PROMPT_TEXT
    audio = [d["audio"] for d in deltas if "audio" in d]
    assert len({a["id"] for a in audio}) == 1
    datas = [base64.b64decode(a["data"]) for a in audio if "data" in a]
    assert len(datas) >= 4  # one chunk per token (and the resampler's tail, if any)
    assert "".join(a.get("transcript", "") for a in audio) == PROMPT_TEXT
    assert "expires_at" in audio[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # pcm16 is 24 kHz, as OpenAI's: played at 24 kHz, 16 kHz audio ran 1.5x too fast
    assert_same_pcm(b"".join(datas), await expected_pcm(cluster, 24_000))


def assert_same_pcm(got: bytes, expected: bytes) -> None:
    """Equal lengths, samples within 1 LSB (soxr's streaming and one-shot rounding)."""
    a, b = np.frombuffer(got, "<i2").astype(int), np.frombuffer(expected, "<i2").astype(int)
    assert len(a) == len(b)
    assert np.abs(a - b).max() <= 1


async def test_text_only_stream_has_no_audio(api: httpx.AsyncClient) -> None:
    resp = await api.post(CHAT, json=chat_body(stream=True, modalities=["text"]))
    chunks = [e for e in sse_events(resp.text) if e != "[DONE]"]
    assert all("audio" not in c["choices"][0]["delta"] for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == PROMPT_TEXT


async def test_whole_chat_returns_text_and_a_wav(
    api: httpx.AsyncClient, cluster: InProcessCluster
) -> None:
    resp = await api.post(CHAT, json=chat_body(**AUDIO_ON))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["content"] == PROMPT_TEXT
    assert message["audio"]["transcript"] == PROMPT_TEXT
    with wave.open(io.BytesIO(base64.b64decode(message["audio"]["data"]))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        frames = w.readframes(w.getnframes())
    assert frames == await expected_pcm(cluster)
    text_only = (await api.post(CHAT, json=chat_body())).json()
    assert text_only["choices"][0]["message"].get("audio") is None


async def test_whole_chat_pcm16(api: httpx.AsyncClient, cluster: InProcessCluster) -> None:
    body = chat_body(modalities=["text", "audio"], audio={"format": "pcm16", "voice": "x"})
    resp = await api.post(CHAT, json=body)
    data = base64.b64decode(resp.json()["choices"][0]["message"]["audio"]["data"])
    assert_same_pcm(data, await expected_pcm(cluster, 24_000))


async def test_speech_is_a_whole_wav_or_streamed_24khz_pcm(
    api: httpx.AsyncClient, cluster: InProcessCluster
) -> None:
    body = {"model": "omni", "input": PROMPT, "voice": "alloy", "response_format": "wav"}
    resp = await api.post("/v1/audio/speech", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(resp.content)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        frames = w.readframes(w.getnframes())
    assert frames == await expected_pcm(cluster)
    # the header's sizes are the file's (a streamed one said 0xFFFFFFFF: "37 hours")
    riff, data = struct.unpack_from("<I", resp.content, 4)[0], resp.content[40:44]
    assert riff == len(resp.content) - 8
    assert struct.unpack("<I", data)[0] == len(frames) == len(resp.content) - 44
    assert int(resp.headers["content-length"]) == len(resp.content)
    raw = await api.post("/v1/audio/speech", json={**body, "response_format": "pcm"})
    assert raw.headers["x-sample-rate"] == "24000"
    assert_same_pcm(raw.content, await expected_pcm(cluster, 24_000))


@pytest.mark.parametrize(
    ("fmt", "media_type", "rate"),
    [("mp3", "audio/mpeg", 16000), ("flac", "audio/flac", 16000), ("opus", "audio/ogg", 16000)],
)
async def test_speech_and_chat_audio_come_in_openais_compressed_formats(
    api: httpx.AsyncClient, cluster: InProcessCluster, fmt: str, media_type: str, rate: int
) -> None:
    """Decoded again, each is the pipeline's audio: its length, and for FLAC its samples."""
    pcm = np.frombuffer(await expected_pcm(cluster), "<i2")
    body = {"model": "omni", "input": PROMPT, "response_format": fmt}
    resp = await api.post("/v1/audio/speech", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == media_type
    chat = chat_body(modalities=["text", "audio"], audio={"format": fmt, "voice": "x"})
    said = (await api.post(CHAT, json=chat)).json()["choices"][0]["message"]["audio"]["data"]
    for data in (resp.content, base64.b64decode(said)):
        decoded, decoded_rate = soundfile.read(io.BytesIO(data), dtype="int16")
        assert decoded_rate == rate
        assert abs(len(decoded) - len(pcm)) <= 2 * 1152, (len(decoded), len(pcm))  # MP3 pads
        if fmt == "flac":  # lossless
            assert np.array_equal(decoded, pcm)


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "opus", "flac"])
async def test_speech_as_server_sent_events_carries_the_same_audio(
    api: httpx.AsyncClient, cluster: InProcessCluster, fmt: str
) -> None:
    """OpenAI's `stream_format: "sse"`: `speech.audio.delta` events whose audio, joined,
    is what the plain request answers (raw PCM: its samples; a file: decoded, as long),
    then `speech.audio.done` with the usage."""
    body = {"model": "omni", "input": PROMPT, "voice": "alloy", "response_format": fmt}
    resp = await api.post("/v1/audio/speech", json={**body, "stream_format": "sse"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    *deltas, done = sse_events(resp.text)
    assert {d["type"] for d in deltas} == {"speech.audio.delta"} and len(deltas) >= 1
    tokens = len(PROMPT_TEXT.split())  # the demo thinker's own count, in and out
    assert done == {
        "type": "speech.audio.done",
        "usage": {"input_tokens": tokens, "output_tokens": tokens, "total_tokens": 2 * tokens},
    }
    data = b"".join(base64.b64decode(d["audio"]) for d in deltas)
    if fmt == "pcm":
        assert_same_pcm(data, await expected_pcm(cluster, 24_000))
        return
    plain = (await api.post("/v1/audio/speech", json=body)).content
    if fmt == "wav":
        assert data == plain
    decoded, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    expected, expected_rate = soundfile.read(io.BytesIO(plain), dtype="int16")
    assert rate == expected_rate and abs(len(decoded) - len(expected)) <= 1152


async def test_models_health_ready(api: httpx.AsyncClient) -> None:
    models = (await api.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["omni"]
    assert (await api.get("/v1/models/omni")).json()["id"] == "omni"
    assert_error(await api.get("/v1/models/gpt-4o"), 404, "model")
    assert (await api.get("/health")).json() == {"status": "ok"}
    assert (await api.get("/ready")).status_code == 200
    page = await api.get("/")
    assert page.status_code == 200
    assert "data-audio-chunks" in page.text


async def test_client_disconnect_aborts_the_request(
    fake_clients: RedisClients, settings: Settings
) -> None:
    async with InProcessCluster(omni(token_delay_ms=300), settings, fake_clients) as cluster:
        app = create_app(gateway_for(cluster))
        gateway: Gateway = app.state.gateway
        aborted: list[str] = []
        async with app.router.lifespan_context(app):
            client = gateway.model("omni").client
            assert client is not None
            real_abort = client.abort

            async def spy(request_id: str, reason: str = "aborted") -> None:
                aborted.append(request_id)
                await real_abort(request_id, reason)

            client.abort = spy  # type: ignore[method-assign]
            sent: list[MutableMapping[str, Any]] = []
            got_text = asyncio.Event()
            body = json.dumps(
                chat_body(
                    "one two three four five six seven eight nine ten", stream=True, **AUDIO_ON
                )
            ).encode()
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await got_text.wait()  # the client hangs up once the first word arrived
                return {"type": "http.disconnect"}

            async def send(message: MutableMapping[str, Any]) -> None:
                sent.append(message)
                if b'"content":"one"' in message.get("body", b""):
                    got_text.set()

            scope = {
                "type": "http",
                "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": CHAT,
                "raw_path": CHAT.encode(),
                "query_string": b"",
                "root_path": "",
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
                "client": ("127.0.0.1", 1),
                "server": ("omni", 80),
            }
            await asyncio.wait_for(app(scope, receive, send), 10)
            assert sent[0]["status"] == 200
            await wait_for(lambda: len(aborted) == 1, 5)
            orch = cluster.service.orchestrator
            # ten words take 3 s, then the talker and code2wav run: only an abort ends it sooner
            await wait_for(lambda: orch.request_states == {}, 2.5)
            assert gateway.inflight == 0
            assert not any(b"[DONE]" in m.get("body", b"") for m in sent)


async def test_streaming_mode_interleaves_audio_with_text(
    fake_clients: RedisClients, settings: Settings
) -> None:
    pipeline = omni(token_delay_ms=100).model_copy(update={"mode": "streaming"})
    prompt = "one two three four five six seven eight nine ten"
    async with (
        InProcessCluster(pipeline, settings, fake_clients) as cluster,
        http(create_app(gateway_for(cluster))) as api,
    ):
        resp = await api.post(CHAT, json=chat_body(prompt, stream=True, **AUDIO_ON))
    deltas = [e["choices"][0]["delta"] for e in sse_events(resp.text) if e != "[DONE]"]
    kinds = []
    for d in deltas:
        kinds += ["text"] * bool(d.get("content")) + ["audio"] * ("data" in d.get("audio", {}))
    assert kinds.count("audio") >= 10  # one per word (and the resampler's tail, if any)
    # the talker and code2wav run while the thinker still thinks: audio arrives between words
    assert kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index("text")
