"""Function calling over the HTTP path: the tools and the choice reach the text stage as
parameters, the history of calls and results reaches it as text, and the calls it answers
with come back in OpenAI's shapes, whole and streamed (an in-process cluster on fakeredis;
the echo stage calls the tool named, its arguments what it was given)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from omni_runtime.http.gateway import Gateway
from tests.integration.http_support import (
    CHAT,
    assert_error,
    fake_redis_clients,
    fast_settings,
    pipeline_of,
    serving,
    sse_events,
    wav_file,
)

pytestmark = pytest.mark.timeout(60)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    },
}
CLOCK = {"type": "function", "function": {"name": "clock"}}
ASKED = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture
async def api() -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    pipelines = [pipeline_of("echo", tools=True)]
    async with serving(pipelines, fake_redis_clients(), fast_settings()) as served:
        yield served


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "echo", "messages": ASKED, "tools": [WEATHER, CLOCK], **extra}


def given(arguments: str) -> dict[str, Any]:
    """What the echo stage was given, from the arguments of the call it made."""
    said: dict[str, Any] = json.loads(arguments)
    return said


async def test_a_call_comes_back_whole_with_the_tools_as_the_stage_read_them(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, gateway = api
    resp = await client.post(CHAT, json=chat(tool_choice="required", parallel_tool_calls=False))
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["audio"] is None
    (call,) = message["tool_calls"]
    rid = resp.headers["X-Omni-Request-Id"]
    assert call["id"] == f"call_{rid}_0" and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    params = given(call["function"]["arguments"])["params"]
    weather = {"name": "get_weather", "description": "The weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip
    clock = {"name": "clock", "parameters": {"type": "object", "properties": {}}}
    assert [json.loads(t) for t in params["tools"]] == [weather, clock]
    assert params["tool_choice"] == "required" and params["parallel_tool_calls"] is False
    assert gateway.inflight == 0


async def test_a_named_choice_calls_that_tool_and_none_calls_nothing(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    named = {"type": "function", "function": {"name": "clock"}}
    resp = await client.post(CHAT, json=chat(tool_choice=named))
    (call,) = resp.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "clock"
    assert given(call["function"]["arguments"])["params"]["tool_name"] == "clock"
    answer = (await client.post(CHAT, json=chat(tool_choice="none"))).json()["choices"][0]
    assert answer["finish_reason"] == "stop" and answer["message"]["tool_calls"] is None
    assert "tools" not in json.loads(answer["message"]["content"])["params"]
    auto = (await client.post(CHAT, json=chat())).json()["choices"][0]["message"]["content"]
    assert "tool_choice" not in json.loads(auto)["params"]  # auto: the stage's default
    assert len(json.loads(auto)["params"]["tools"]) == 2


async def test_streamed_calls_are_deltas_with_their_index_then_the_finish(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    body = chat(tool_choice="required", stream=True, modalities=["text", "audio"])
    body["audio"] = {"voice": "low", "format": "pcm16"}
    resp = await client.post(CHAT, json=body)
    assert resp.status_code == 200, resp.text
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0] for e in events[:-1]]
    calls = [d["delta"]["tool_calls"] for d in deltas if "tool_calls" in d["delta"]]
    assert len(calls) == 1 and [c["index"] for c in calls[0]] == [0]
    assert calls[0][0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0][0]["function"]["arguments"])["prompt"]["messages"][-1] == ASKED[0]
    assert [d["finish_reason"] for d in deltas if d.get("finish_reason")] == ["tool_calls"]
    assert not any(d["delta"].get("content") for d in deltas)


async def test_the_history_of_calls_and_results_reaches_the_stage_as_text(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    made = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    history = [
        *ASKED,
        {"role": "assistant", "content": None, "tool_calls": [made]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
        {"role": "tool", "tool_call_id": "call_9", "content": "unasked"},
    ]
    resp = await client.post(CHAT, json=chat(messages=history))
    assert resp.status_code == 200, resp.text
    prompt = json.loads(resp.json()["choices"][0]["message"]["content"])["prompt"]
    assert prompt["messages"][1:] == [
        {"role": "assistant", "content": 'Let me call get_weather with {"city": "Oslo"}.'},
        {"role": "user", "content": 'Result of get_weather: {"sky": "clear"}'},
        {"role": "user", "content": "Result of a tool: unasked"},
    ]  # fmt: skip


async def test_a_spoken_questions_calls_and_results_follow_what_is_heard() -> None:
    """On a pipeline that hears, the messages after the spoken question (its calls, their
    results) come `after` it: its speech-to-text stage's words go in its place, not last."""
    spoken = {"type": "input_audio", "input_audio": {"data": base64.b64encode(
        wav_file(0.5)).decode(), "format": "wav"}}  # fmt: skip
    made = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    history = [
        {"role": "user", "content": "Be brief."},
        {"role": "user", "content": [spoken]},
        {"role": "assistant", "content": None, "tool_calls": [made]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    hears = pipeline_of("echo", input="audio", tools=True)
    async with serving([hears], fake_redis_clients(), fast_settings()) as (client, _g):
        resp = await client.post(CHAT, json=chat(messages=history))
    assert resp.status_code == 200, resp.text
    prompt = json.loads(resp.json()["choices"][0]["message"]["content"])["prompt"]
    assert prompt == {
        "wav": f"<{len(wav_file(0.5))} bytes>",
        "messages": [{"role": "user", "content": "Be brief."}],
        "after": [
            {"role": "assistant", "content": 'Let me call get_weather with {"city": "Oslo"}.'},
            {"role": "user", "content": 'Result of get_weather: {"sky": "clear"}'},
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters":
          {"type": "object", "description": "x" * 3000}}}]}, "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "d" * 3000,
          "parameters": {"type": "object", "description": "x" * 1500}}}]}, "tools.0.function"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)  # fmt: skip
async def test_tools_that_cannot_be_called_are_400(
    api: tuple[httpx.AsyncClient, Gateway], extra: dict[str, Any], param: str
) -> None:
    client, gateway = api
    body = {k: v for k, v in chat(**extra).items() if v is not None}
    assert_error(await client.post(CHAT, json=body), 400, param)
    assert gateway.inflight == 0


async def test_a_pipeline_that_calls_no_tools_refuses_them_unless_told_none() -> None:
    async with serving([pipeline_of("echo")], fake_redis_clients(), fast_settings()) as (
        client,
        _gateway,
    ):
        error = assert_error(await client.post(CHAT, json=chat()), 400, "tools")
        assert error["code"] == "unsupported_parameter" and "outputs.tools" in error["message"]
        told_none = await client.post(CHAT, json=chat(tool_choice="none"))
        assert told_none.status_code == 200, told_none.text
