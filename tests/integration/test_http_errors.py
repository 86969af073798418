"""The HTTP front end's failures: OpenAI error objects for bad input, auth, limits and the pipeline."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_runtime.errors import OOM_MESSAGE
from omni_runtime.http.app import create_app
from omni_runtime.http.errors import OOM_RETRY_AFTER_S
from omni_runtime.http.gateway import Gateway
from omni_runtime.http.settings import ServeSettings
from omni_runtime.pipeline import OutputsConfig, load_pipeline
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings
from tests.cluster import InProcessCluster
from tests.integration.http_support import (
    AUDIO_ON,
    CHAT,
    WORKERS,
    assert_error,
    chat_body,
    fake_redis_clients,
    fast_settings,
    gateway_for,
    http,
    omni,
    sse_events,
)
from tests.redis_full import FullableRedis
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


async def test_not_ready_without_workers(fake_clients: RedisClients, settings: Settings) -> None:
    gateway = Gateway(omni(), settings, fake_clients, ServeSettings(ready_cache_s=0))
    async with http(create_app(gateway)) as api:
        assert (await api.get("/health")).status_code == 200
        error = assert_error(await api.get("/ready"), 503)
        assert "orchestrator" in error["message"]
        assert_error(await api.post(CHAT, json=chat_body()), 503)


async def test_once_the_drain_begins_nothing_new_is_taken(cluster: InProcessCluster) -> None:
    """`Gateway.stop` (serve's first stop signal): readiness and new requests answer 503
    `shutting_down`, so a balancer and a client go elsewhere (what runs goes on:
    tests/e2e/test_serve_drain.py)."""
    gateway = gateway_for(cluster)
    async with http(create_app(gateway)) as api:
        assert (await api.get("/ready")).status_code == 200
        gateway.stop()
        assert assert_error(await api.get("/ready"), 503)["code"] == "shutting_down"
        refused = await api.post(CHAT, json=chat_body())
        assert assert_error(refused, 503)["code"] == "shutting_down"
        assert "Retry-After" in refused.headers
        assert (await api.get("/health")).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "omni"}, "messages"),
        (chat_body(modalities=["video"]), "modalities.0"),
        (chat_body(audio={"format": "aac"}), "audio.format"),
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
    error = assert_error(bad_json, 400)
    assert error["code"] == "invalid_json"
    assert error["param"] is None  # where the parser stopped is no field of the request
    assert error["message"].startswith("the request body is not valid JSON: ")
    assert error["message"].endswith(" at character 1"), error
    speech = {"model": "omni", "input": "hi", "response_format": "aac"}  # no encoder here
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


async def test_pages_of_the_cors_origins_may_call_the_api_and_no_other(
    cluster: InProcessCluster,
) -> None:
    """A preflight needs no key; answers, errors included, say the origin may read them
    and which headers it may see; another origin gets no such header (the browser then
    hides the answer), and without OMNI_CORS_ORIGINS no origin does."""
    app = create_app(gateway_for(cluster, api_keys="first-key-123", cors_origins="http://app.test"))
    page = {"Origin": "http://app.test"}
    ok = {**page, "Authorization": "Bearer first-key-123"}
    async with http(app) as api:
        preflight = await api.options(CHAT, headers={
            **page, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        })  # fmt: skip
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == "http://app.test"
        allowed = preflight.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed and "content-type" in allowed
        answer = await api.post(CHAT, json=chat_body(), headers=ok)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "http://app.test"
        exposed = answer.headers["access-control-expose-headers"].lower()
        assert "x-omni-request-id" in exposed
        refused = await api.get("/v1/models", headers=page)  # no key: a 401 the page can read
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == "http://app.test"
        other = await api.get("/v1/models", headers={**ok, "Origin": "http://evil.test"})
        assert "access-control-allow-origin" not in other.headers
        bad = await api.options(CHAT, headers={
            "Origin": "http://evil.test", "Access-Control-Request-Method": "POST",
        })  # fmt: skip
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    async with http(create_app(gateway_for(cluster))) as api:
        plain = await api.get("/v1/models", headers=page)
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


async def test_metrics_need_no_key_and_time_what_serve_saw(cluster: InProcessCluster) -> None:
    app = create_app(gateway_for(cluster, api_keys="first-key-123"))
    ok = {"Authorization": "Bearer first-key-123"}
    async with http(app) as api:
        body = chat_body(stream=True, **AUDIO_ON)
        for _ in range(2):
            assert (await api.post(CHAT, json=body, headers=ok)).status_code == 200
        resp = await api.get("/metrics")  # no key: Prometheus scrapes it
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        assert (await api.post("/metrics")).status_code == 405
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    timed = ("omni_time_to_first_token_seconds", "omni_time_to_first_audio_seconds")
    for name in (*timed, "omni_audio_gap_seconds"):  # gap: one per request heard
        (count,) = [s for s in families[name].samples if s.name == f"{name}_count"]
        assert count.value == 2 and count.labels["role"] == "serve"
    (received,) = families["omni_requests_received"].samples
    assert received.value == 2


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
            # a streamed response that fails gave its id: it is kept, failed, with its error
            asked = {"model": "seed", "input": "a boom b", "stream": True}
            streamed = (await api.post("/v1/responses", json=asked)).text
            last = json.loads(streamed.strip().rsplit("data: ", 1)[1])
            assert last["type"] == "response.failed", last
            kept = (await api.get(f"/v1/responses/{last['response']['id']}")).json()
            assert kept["status"] == "failed" and "boom" in kept["error"]["message"], kept
            assert app.state.gateway.inflight == 0


async def test_redis_out_of_memory_answers_503_with_retry_after_and_ready_says_so(
    full_redis: FullableRedis,
) -> None:
    """A submission Redis refuses for memory is shed at once; `/ready` names the condition
    while it lasts; once Redis has room, requests are served again."""
    settings = fast_settings().model_copy(update={"redis_url": full_redis.url})
    clients = RedisClients.from_url(full_redis.url)
    async with (
        InProcessCluster(omni(), settings, clients) as cluster,
        http(create_app(gateway_for(cluster))) as api,
    ):
        with full_redis.full():
            resp = await api.post(CHAT, json=chat_body())
            error = assert_error(resp, 503)
            assert error["code"] == "redis_out_of_memory"
            assert error["message"].startswith(OOM_MESSAGE)
            assert resp.headers["Retry-After"] == str(OOM_RETRY_AFTER_S)

            ready = await api.get("/ready")
            for _ in range(100):  # the server's client hears it with its next heartbeat
                if ready.status_code == 503:
                    break
                await asyncio.sleep(0.05)
                ready = await api.get("/ready")
            assert assert_error(ready, 503)["code"] == "redis_out_of_memory"
        for _ in range(100):
            ready = await api.get("/ready")
            if ready.status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert ready.status_code == 200
        assert (await api.post(CHAT, json=chat_body())).status_code == 200
