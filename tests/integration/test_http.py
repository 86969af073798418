"""The HTTP front end over an in-process cluster on fakeredis: OpenAI shapes, errors, aborts."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from omni_runtime.http.app import create_app
from omni_runtime.http.audio import pcm16
from omni_runtime.http.gateway import Gateway
from omni_runtime.http.settings import ServeSettings
from omni_runtime.pipeline import OutputsConfig, PipelineConfig, load_pipeline
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings
from tests.cluster import InProcessCluster
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

WORKERS = Path(__file__).resolve().parents[2] / "workers"
PROMPT = "Hello, world!"
CHAT = "/v1/chat/completions"
AUDIO_ON = {"modalities": ["text", "audio"], "audio": {"format": "wav", "voice": "x"}}


def omni(token_delay_ms: float = 1) -> PipelineConfig:
    pipeline = load_pipeline(WORKERS / "omni.yaml")
    stages = [s.model_copy(deep=True) for s in pipeline.stages]
    stages[0].options["token_delay_ms"] = token_delay_ms
    return pipeline.model_copy(update={"stages": stages})


@pytest.fixture
def fake_clients() -> RedisClients:
    server = fakeredis.FakeServer()
    return RedisClients(
        sync=lambda: fakeredis.FakeRedis(server=server),
        aio=lambda: fakeredis.FakeAsyncRedis(server=server),
    )


@pytest.fixture
def settings() -> Settings:
    return Settings(redis_url="redis://unused", block_ms=20, heartbeat_interval_s=0.2)


@pytest.fixture
async def cluster(
    fake_clients: RedisClients, settings: Settings
) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(omni(), settings, fake_clients) as c:
        yield c


def gateway_for(cluster: InProcessCluster, **serve: Any) -> Gateway:
    serve.setdefault("ready_cache_s", 0)
    return Gateway(cluster.pipeline, cluster.settings, cluster.clients, ServeSettings(**serve))


@asynccontextmanager
async def http(app: FastAPI, raise_errors: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_errors)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://omni") as client,
    ):
        yield client


@pytest.fixture
async def api(cluster: InProcessCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with http(create_app(gateway_for(cluster))) as client:
        yield client


def chat_body(prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return {"model": "omni", "messages": [{"role": "user", "content": prompt}], **extra}


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of an event stream, JSON-decoded except the `[DONE]` marker."""
    assert text.endswith("\n\n")
    events = []
    for block in text.strip("\n").split("\n\n"):
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def expected_pcm(cluster: InProcessCluster) -> bytes:
    """What the pipeline itself says for PROMPT, as 16-bit PCM."""
    outs = await cluster.run(PROMPT)
    return b"".join(pcm16(np.asarray(o.data, np.float32)) for o in outs if o.stage_id == 2)


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


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
    assert "".join(d.get("content", "") for d in deltas) == "Hello , world !"
    audio = [d["audio"] for d in deltas if "audio" in d]
    assert len({a["id"] for a in audio}) == 1
    datas = [base64.b64decode(a["data"]) for a in audio if "data" in a]
    assert len(datas) == 4  # one chunk per token
    assert "".join(a.get("transcript", "") for a in audio) == "Hello , world !"
    assert "expires_at" in audio[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert b"".join(datas) == await expected_pcm(cluster)


async def test_text_only_stream_has_no_audio(api: httpx.AsyncClient) -> None:
    resp = await api.post(CHAT, json=chat_body(stream=True, modalities=["text"]))
    chunks = [e for e in sse_events(resp.text) if e != "[DONE]"]
    assert all("audio" not in c["choices"][0]["delta"] for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello , world !"


async def test_whole_chat_returns_text_and_a_wav(
    api: httpx.AsyncClient, cluster: InProcessCluster
) -> None:
    resp = await api.post(CHAT, json=chat_body(**AUDIO_ON))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["content"] == "Hello , world !"
    assert message["audio"]["transcript"] == "Hello , world !"
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
    assert data == await expected_pcm(cluster)


async def test_speech_streams_a_playable_wav_and_raw_pcm(
    api: httpx.AsyncClient, cluster: InProcessCluster
) -> None:
    body = {"model": "omni", "input": PROMPT, "voice": "alloy", "response_format": "wav"}
    resp = await api.post("/v1/audio/speech", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(resp.content)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        frames = w.readframes(w.getnframes())
    expected = await expected_pcm(cluster)
    assert frames == expected
    raw = await api.post("/v1/audio/speech", json={**body, "response_format": "pcm"})
    assert raw.content == expected


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


async def test_not_ready_without_workers(fake_clients: RedisClients, settings: Settings) -> None:
    gateway = Gateway(omni(), settings, fake_clients, ServeSettings(ready_cache_s=0))
    async with http(create_app(gateway)) as api:
        assert (await api.get("/health")).status_code == 200
        error = assert_error(await api.get("/ready"), 503)
        assert "orchestrator" in error["message"]
        assert_error(await api.post(CHAT, json=chat_body()), 503)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "omni"}, "messages"),
        (chat_body(modalities=["video"]), "modalities.0"),
        (chat_body(audio={"format": "mp3"}), "audio.format"),
        ({"model": "omni", "messages": [{"role": "system", "content": "x"}]}, None),
        (chat_body(prompt="   "), "messages"),
        (chat_body(prompt="x" * 40_000), "messages"),
    ],
)
async def test_bad_chat_bodies_are_400(
    api: httpx.AsyncClient, body: dict[str, Any], param: str | None
) -> None:
    error = assert_error(await api.post(CHAT, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


async def test_other_client_errors(api: httpx.AsyncClient) -> None:
    bad_json = await api.post(CHAT, content=b"{nope", headers={"content-type": "application/json"})
    assert assert_error(bad_json, 400)["code"] == "invalid_json"
    speech = {"model": "omni", "input": "hi", "response_format": "mp3"}
    assert_error(await api.post("/v1/audio/speech", json=speech), 400, "response_format")
    assert_error(await api.post(CHAT, json={**chat_body(), "model": "gpt-4o"}), 404, "model")
    assert_error(await api.get("/v1/nothing"), 404)
    assert_error(await api.get(CHAT), 405)
    huge = chat_body(prompt="x" * (2 * 1024 * 1024))
    assert assert_error(await api.post(CHAT, json=huge), 413)["code"] == "request_too_large"


async def test_api_keys(cluster: InProcessCluster) -> None:
    app = create_app(gateway_for(cluster, api_keys="first-key-123, second-key-456"))
    async with http(app) as api:
        assert_error(await api.get("/v1/models"), 401)
        wrong = {"Authorization": "Bearer nope-nope-nope"}
        assert assert_error(await api.get("/v1/models", headers=wrong), 401)["code"] == (
            "invalid_api_key"
        )
        ok = {"Authorization": "Bearer second-key-456"}
        assert (await api.get("/v1/models", headers=ok)).status_code == 200
        assert (await api.post(CHAT, json=chat_body(), headers=ok)).status_code == 200
        assert (await api.get("/health")).status_code == 200  # probes need no key


async def test_max_inflight_is_429(fake_clients: RedisClients, settings: Settings) -> None:
    async with InProcessCluster(omni(token_delay_ms=50), settings, fake_clients) as cluster:
        gateway = gateway_for(cluster, max_inflight=1)
        async with http(create_app(gateway)) as api:
            first = asyncio.create_task(api.post(CHAT, json=chat_body()))
            await wait_for(lambda: gateway.inflight == 1)
            error = assert_error(await api.post(CHAT, json=chat_body()), 429)
            assert error["type"] == "rate_limit_error"
            assert (await first).status_code == 200
            assert gateway.inflight == 0
            assert (await api.post(CHAT, json=chat_body())).status_code == 200


async def test_unexpected_failure_is_a_json_500(
    api: httpx.AsyncClient, cluster: InProcessCluster
) -> None:
    app = create_app(gateway_for(cluster))
    gateway: Gateway = app.state.gateway

    async def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("secret internals")

    gateway.open = broken  # type: ignore[method-assign]
    async with http(app, raise_errors=False) as client:
        resp = await client.post(CHAT, json=chat_body())
    error = assert_error(resp, 500)
    assert "secret" not in resp.text and "Traceback" not in resp.text
    assert error["type"] == "server_error"


async def test_stage_failure_is_an_openai_error(
    fake_clients: RedisClients, settings: Settings
) -> None:
    seed = load_pipeline(WORKERS / "seed.yaml")
    stages = [s.model_copy(deep=True) for s in seed.stages]
    stages[1].options["fail_word"] = "boom"
    seed = seed.model_copy(update={"stages": stages, "outputs": OutputsConfig(text_stage=0)})
    async with InProcessCluster(seed, settings, fake_clients) as cluster:
        app = create_app(gateway_for(cluster))
        async with http(app) as api:
            body = {**chat_body("a boom b"), "model": "seed"}
            error = assert_error(await api.post(CHAT, json=body), 502)
            assert "boom" in error["message"]
            events = sse_events((await api.post(CHAT, json={**body, "stream": True})).text)
            assert "boom" in events[-1]["error"]["message"]
            assert app.state.gateway.inflight == 0


async def test_client_disconnect_aborts_the_request(
    fake_clients: RedisClients, settings: Settings
) -> None:
    async with InProcessCluster(omni(token_delay_ms=100), settings, fake_clients) as cluster:
        app = create_app(gateway_for(cluster))
        gateway: Gateway = app.state.gateway
        aborted: list[str] = []
        async with app.router.lifespan_context(app):
            assert gateway.client is not None
            real_abort = gateway.client.abort

            async def spy(request_id: str, reason: str = "aborted") -> None:
                aborted.append(request_id)
                await real_abort(request_id, reason)

            gateway.client.abort = spy  # type: ignore[method-assign]
            sent: list[dict[str, Any]] = []
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

            async def send(message: dict[str, Any]) -> None:
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
            await wait_for(lambda: orch.request_states == {}, 5)  # long before ten words took 1 s
            assert gateway.inflight == 0
            assert not any(b"[DONE]" in m.get("body", b"") for m in sent)
