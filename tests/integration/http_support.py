"""Helpers of the HTTP tests: the omni demo and the test pipelines on in-process clusters,
an app client, parsers."""

from __future__ import annotations

import io
import json
import wave
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import numpy as np
import soxr
from fastapi import FastAPI

from omni_runtime.http.app import create_app
from omni_runtime.http.audio import pcm16
from omni_runtime.http.gateway import Gateway, check_served
from omni_runtime.http.settings import ServeSettings
from omni_runtime.pipeline import PipelineConfig, load_pipeline
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings
from tests.cluster import InProcessCluster

WORKERS = Path(__file__).resolve().parents[2] / "workers"
PROMPT = "Hello, world!"
PROMPT_TEXT = "Hello , world !"
"""PROMPT as the omni demo's text stage says it: its tokens, joined by the file's separator."""
CHAT = "/v1/chat/completions"
AUDIO_ON: dict[str, Any] = {
    "modalities": ["text", "audio"],
    "audio": {"format": "wav", "voice": "x"},
}


def omni(token_delay_ms: float = 1) -> PipelineConfig:
    pipeline = load_pipeline(WORKERS / "omni.yaml")
    stages = [s.model_copy(deep=True) for s in pipeline.stages]
    stages[0].options["token_delay_ms"] = token_delay_ms
    return pipeline.model_copy(update={"stages": stages})


def fake_redis_clients() -> RedisClients:
    server = fakeredis.FakeServer()
    return RedisClients(
        sync=lambda: fakeredis.FakeRedis(server=server),
        aio=lambda: fakeredis.FakeAsyncRedis(server=server),
    )


def fast_settings() -> Settings:
    return Settings(
        redis_url="redis://unused",
        block_ms=20,
        orchestrator_idle_block_ms=20,  # fakeredis goes on with a cancelled blocking read
        heartbeat_interval_s=0.2,
    )


def gateway_for(cluster: InProcessCluster, **serve: Any) -> Gateway:
    serve.setdefault("ready_cache_s", 0)
    return Gateway(cluster.pipeline, cluster.settings, cluster.clients, ServeSettings(**serve))


@asynccontextmanager
async def http(app: FastAPI, raise_errors: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client on the app, inside the app's lifespan (httpx does not run it)."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_errors)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://omni") as client,
    ):
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


async def expected_pcm(cluster: InProcessCluster, rate: int | None = None) -> bytes:
    """What the pipeline itself says for PROMPT, as 16-bit PCM: at its own rate, or
    resampled to `rate` (24 kHz: OpenAI's raw formats)."""
    outs = await cluster.run(PROMPT)
    chunks = [np.asarray(o.data, np.float32) for o in outs if o.stage_id == 2]
    if rate is None:
        return b"".join(pcm16(c) for c in chunks)
    samples = np.concatenate(chunks)
    own = cluster.pipeline.outputs.sample_rate if cluster.pipeline.outputs else 16000
    return pcm16(soxr.resample(samples, own, rate, quality="HQ").astype(np.float32))


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI error object with this status (and param); returns it."""
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


TESTS = Path(__file__).resolve().parents[1]


def pipeline_of(name: str, **outputs: Any) -> PipelineConfig:
    """A pipeline of tests/pipelines/ (`echo`, `transcribe`), its `outputs` changed by these."""
    pipeline = load_pipeline(TESTS / "pipelines" / f"{name}.yaml")
    if outputs:
        assert pipeline.outputs is not None
        changed = pipeline.outputs.model_copy(update=outputs)
        pipeline = pipeline.model_copy(update={"outputs": changed})
    return pipeline


@asynccontextmanager
async def serving(
    pipelines: list[PipelineConfig], clients: RedisClients, settings: Settings, **serve: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    """One server fronting several pipelines, each an in-process cluster in its namespace."""
    namespaces = check_served(pipelines, settings.namespace)
    async with AsyncExitStack() as stack:
        for pipeline, namespace in zip(pipelines, namespaces, strict=True):
            own = settings.model_copy(update={"namespace": namespace})
            await stack.enter_async_context(InProcessCluster(pipeline, own, clients))
        serve.setdefault("ready_cache_s", 0)
        gateway = Gateway(pipelines, settings, clients, ServeSettings(**serve))
        async with http(create_app(gateway)) as client:
            yield client, gateway


def wav_file(seconds: float, rate: int = 16000, channels: int = 1) -> bytes:
    """A WAV of silence, `seconds` long."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * channels * round(seconds * rate))
    return out.getvalue()
