"""Responses the server keeps (`store`), with the official `openai` client over the HTTP
path (in-process clusters on fakeredis): `previous_response_id` continues a conversation,
whole or streamed, on any replica of the server; `GET` and `DELETE /v1/responses/{id}`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from omni_runtime.http.app import create_app
from omni_runtime.http.gateway import Gateway
from omni_runtime.http.settings import ServeSettings
from tests.integration.http_support import (
    assert_error,
    fake_redis_clients,
    fast_settings,
    http,
    pipeline_of,
    serving,
)
from tests.integration.test_http_responses import RESPONSES, WEATHER, said, sdk

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def api() -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    pipelines = [pipeline_of("echo", tools=True)]
    async with serving(pipelines, fake_redis_clients(), fast_settings()) as served:
        yield served


def turns(answer: str) -> list[dict[str, Any]]:
    """The messages the echo stage was given."""
    messages: list[dict[str, Any]] = said(answer)["prompt"]["messages"]
    return messages


def kept(response: Any) -> bool:
    """The body's `store` (which the client's types leave out)."""
    store: bool = response.to_dict()["store"]
    return store


async def test_previous_response_id_continues_the_conversation_it_kept(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    oai = sdk(client)
    first = await oai.responses.create(model="echo", instructions="Be brief.", input="Hi")
    assert kept(first) is True and first.previous_response_id is None
    second = await oai.responses.create(
        model="echo", instructions="Be kind.", input="And you?", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    # the first one's input and answer come before; its instructions do not (OpenAI's rule)
    assert turns(second.output_text) == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And you?"},
    ]
    # streamed, on the chain of two: kept too, and continued in turn
    stream = await oai.responses.create(
        model="echo", input="Go on.", previous_response_id=second.id, stream=True
    )
    events = [ev async for ev in stream]
    third = events[-1].response  # type: ignore[union-attr]
    assert kept(events[0].response) and kept(third)  # type: ignore[union-attr]
    fourth = await oai.responses.create(model="echo", input="End.", previous_response_id=third.id)
    assert [m["content"] for m in turns(fourth.output_text)] == [
        "Hi", first.output_text, "And you?", second.output_text, "Go on.", third.output_text,
        "End.",
    ]  # fmt: skip
    got = await oai.responses.retrieve(third.id)
    assert (got.id, got.status, got.output_text) == (third.id, "completed", third.output_text)


async def called_and_answered(oai: openai.AsyncOpenAI) -> tuple[Any, Any]:
    """A response that calls get_weather, and the one after it given the call's output
    by `previous_response_id` alone: (the call, that answer)."""
    asked = await oai.responses.create(
        model="echo", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required"
    )
    (call,) = asked.output
    assert call.type == "function_call"
    output: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "clear"}]
    answer = await oai.responses.create(
        model="echo", input=output, tools=[WEATHER], previous_response_id=asked.id
    )
    return call, answer


async def test_a_call_is_answered_after_the_response_that_made_it(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    oai = sdk(client)
    call, answer = await called_and_answered(oai)
    assert turns(answer.output_text)[1:] == [
        {"role": "assistant", "content": f"Let me call get_weather with {call.arguments}."},
        {"role": "user", "content": "Result of get_weather: clear"},
    ]


async def test_deleted_unkept_and_unknown_responses(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, gateway = api
    oai = sdk(client)
    first = await oai.responses.create(model="echo", input="Hi")
    second = await oai.responses.create(model="echo", input="More", previous_response_id=first.id)
    deleted = await client.delete(f"{RESPONSES}/{first.id}")
    assert deleted.json() == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(first.id)
    assert_error(await client.delete(f"{RESPONSES}/{first.id}"), 404)
    with pytest.raises(openai.BadRequestError) as refused:
        await oai.responses.create(model="echo", input="Again", previous_response_id=first.id)
    assert refused.value.code == "previous_response_not_found"
    assert refused.value.param == "previous_response_id"
    # the second one holds the whole conversation: deleting the first one loses nothing
    third = await oai.responses.create(model="echo", input="Last", previous_response_id=second.id)
    assert turns(third.output_text)[0]["content"] == "Hi"
    unkept = await oai.responses.create(model="echo", input="Hi", store=False)
    assert kept(unkept) is False
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(unkept.id)
    # what Redis holds under a response's name is read as input is: garbage is no response
    assert gateway.kept is not None
    await gateway.kept.redis.set(gateway.settings.names.kept_response("resp_x"), b"\x93garbage")
    body = {"model": "echo", "input": "Hi", "previous_response_id": "resp_x"}
    error = assert_error(await client.post(RESPONSES, json=body), 400, "previous_response_id")
    assert error["code"] == "previous_response_not_found"
    malformed = gateway.metrics.value("omni_malformed_entries_total", stream="kept responses")
    assert malformed == 1


async def test_a_conversation_begun_on_one_replica_goes_on_on_another() -> None:
    pipelines = [pipeline_of("echo")]
    clients = fake_redis_clients()
    async with serving(pipelines, clients, fast_settings()) as (client, gateway):
        first = await sdk(client).responses.create(model="echo", input="Hi")
        other = Gateway(pipelines, gateway.settings, clients, ServeSettings(ready_cache_s=0))
        async with http(create_app(other)) as replica:
            second = await sdk(replica).responses.create(
                model="echo", input="And?", previous_response_id=first.id
            )
            assert [m["content"] for m in turns(second.output_text)] == [
                "Hi", first.output_text, "And?"
            ]  # fmt: skip
            got = await sdk(replica).responses.retrieve(first.id)
            assert got.output_text == first.output_text


async def test_a_server_told_to_keep_nothing_says_so() -> None:
    pipelines = [pipeline_of("echo")]
    keep_none = fast_settings().model_copy(update={"responses_ttl_s": 0})
    async with serving(pipelines, fake_redis_clients(), keep_none) as (client, _gateway):
        oai = sdk(client)
        got = await oai.responses.create(model="echo", input="Hi")
        assert kept(got) is False
        with pytest.raises(openai.NotFoundError):
            await oai.responses.retrieve(got.id)
        stream = await oai.responses.create(model="echo", input="Hi", stream=True)
        events = [ev async for ev in stream]
        assert kept(events[-1].response) is False  # type: ignore[union-attr]
        assert json.loads(events[-1].response.output_text)  # type: ignore[union-attr]


async def test_a_kept_responses_input_items_are_listed_and_paged(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    """What it read: the conversation before it and its own input, not its output."""
    client, _gateway = api
    oai = sdk(client)
    call, answer = await called_and_answered(oai)
    listed = [item async for item in oai.responses.input_items.list(answer.id, order="asc")]
    assert [item.type for item in listed] == ["message", "function_call", "function_call_output"]
    first: Any = listed[0].to_dict()
    assert first["content"] == [{"type": "input_text", "text": "Weather in Oslo?"}]
    assert listed[1].call_id == listed[2].call_id == call.call_id  # type: ignore[union-attr]
    assert len({item.id for item in listed}) == 3
    newest = await oai.responses.input_items.list(answer.id, limit=2)  # desc: newest first
    assert [item.type for item in newest.data] == ["function_call_output", "function_call"]
    assert newest.has_more and newest.data[-1].id == listed[1].id
    rest = await oai.responses.input_items.list(answer.id, limit=2, after=listed[1].id)
    assert [item.id for item in rest.data] == [listed[0].id] and not rest.has_more
    with pytest.raises(openai.NotFoundError):
        await oai.responses.input_items.list("resp_gone")
