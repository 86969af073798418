"""`POST /v1/responses` with the official `openai` client, over the HTTP path (in-process
clusters on fakeredis): the request reaches the stages as the chat it amounts to, the
answer comes back as Responses output items, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
import openai
import pytest

from omni_runtime.http.gateway import Gateway
from tests.integration.http_support import (
    PROMPT,
    PROMPT_TEXT,
    assert_error,
    fake_redis_clients,
    fast_settings,
    omni,
    pipeline_of,
    serving,
)

pytestmark = pytest.mark.timeout(60)

WEATHER: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip
RESPONSES = "/v1/responses"


@pytest.fixture
async def api() -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    pipelines = [pipeline_of("echo", tools=True, structured=True), omni()]
    async with serving(pipelines, fake_redis_clients(), fast_settings()) as served:
        yield served


def sdk(client: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://omni/v1", api_key="unused", http_client=cast(Any, client), max_retries=0
    )


def said(text: str) -> dict[str, Any]:
    """What the echo stage was given (its answer, or a call's arguments, is that as JSON)."""
    got: dict[str, Any] = json.loads(text)
    return got


async def test_a_response_reaches_the_stage_as_the_chat_it_amounts_to(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, gateway = api
    conversation: Any = [
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "How are you?"}]},
    ]  # fmt: skip
    got = await sdk(client).responses.create(
        model="echo", instructions="Be brief.", input=conversation,
        max_output_tokens=40, temperature=0.5, metadata={"turn": "3"}, truncation="auto",
    )  # fmt: skip
    assert got.status == "completed" and got.object == "response"
    assert got.id.startswith("resp_") and got.metadata == {"turn": "3"}
    (message,) = got.output
    assert message.type == "message" and message.role == "assistant"
    stage = said(got.output_text)
    assert stage["prompt"]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "How are you?"},
    ]
    # no audio asked: the pipeline's tone stage is not run (`modalities`)
    assert stage["params"] == {
        "max_tokens": 40, "temperature": 0.5, "truncation": "auto", "modalities": ["text"]
    }  # fmt: skip
    assert got.truncation == "auto"
    assert got.usage is not None and got.usage.input_tokens > 0
    assert got.usage.total_tokens == got.usage.input_tokens + got.usage.output_tokens
    assert gateway.inflight == 0


async def test_a_call_and_its_output_come_and_go_as_items(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    asked = await sdk(client).responses.create(
        model="echo", input="Weather in Oslo?", tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    (call,) = asked.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id == f"call_{asked.id.removeprefix('resp_')}_0"
    params = said(call.arguments)["params"]
    assert params["tool_choice"] == "required" and params["parallel_tool_calls"] is False
    assert [json.loads(t)["name"] for t in params["tools"]] == ["get_weather"]
    history: Any = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": '{"sky": "clear"}'},
    ]  # fmt: skip
    answer = await sdk(client).responses.create(model="echo", input=history, tools=[WEATHER])
    assert said(answer.output_text)["prompt"]["messages"][1:] == [
        {"role": "assistant", "content": 'Let me call get_weather with {"city": "Oslo"}.'},
        {"role": "user", "content": 'Result of get_weather: {"sky": "clear"}'},
    ]


async def test_a_streamed_response_is_openais_events_in_order(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, gateway = api
    stream = await sdk(client).responses.create(model="omni", input=PROMPT, stream=True)
    events = [ev async for ev in stream]
    kinds = [ev.type for ev in events]
    deltas = [ev.delta for ev in events if ev.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    assert len(deltas) > 1 and "".join(deltas) == PROMPT_TEXT
    done = events[-1].response  # type: ignore[union-attr]
    assert done.status == "completed" and done.output_text == PROMPT_TEXT
    assert gateway.inflight == 0


async def test_what_the_server_cannot_honour_is_400(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, gateway = api
    body = {"model": "echo", "input": "Hi", "top_logprobs": 2}
    error = assert_error(await client.post(RESPONSES, json=body), 400, "top_logprobs")
    assert error["code"] == "unsupported_parameter", error
    unkept = {"model": "echo", "input": "Hi", "background": True, "store": False}
    error = assert_error(await client.post(RESPONSES, json=unkept), 400, "background")
    assert error["code"] == "invalid_value", error
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    resp = await client.post(RESPONSES, json={"model": "echo", "input": [image]})
    assert resp.status_code == 400, resp.text
    search = {"model": "echo", "input": "Hi", "tools": [{"type": "web_search"}]}
    assert (await client.post(RESPONSES, json=search)).status_code == 400
    only_output = [{"type": "function_call_output", "call_id": "c", "output": "x"}]
    error = assert_error(
        await client.post(RESPONSES, json={"model": "echo", "input": only_output}), 400, "input"
    )
    assert "user message" in error["message"], error
    shaped = {"model": "omni", "input": "Hi", "text": {"format": {"type": "json_object"}}}
    error = assert_error(await client.post(RESPONSES, json=shaped), 400, "response_format")
    assert "does not shape its answers as JSON" in error["message"]
    assert gateway.inflight == 0


async def test_json_asked_for_reaches_the_stage_as_its_schema(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    fmt: Any = {"type": "json_schema", "name": "count", "schema": schema, "strict": True}
    got = await sdk(client).responses.create(model="echo", input="Count", text={"format": fmt})
    params = said(got.output_text)["params"]
    assert params["response_format"] == "json_schema"
    assert json.loads(params["json_schema"]) == schema
