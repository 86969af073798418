"""OpenAI's Conversations API with the official `openai` client over the HTTP path
(in-process clusters on fakeredis): conversations made, read, changed and deleted, their
items paged, and responses that read a conversation and add their turn to it."""

from __future__ import annotations

import asyncio
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
    omni,
    pipeline_of,
    serving,
)
from tests.integration.test_http_kept_responses import turns
from tests.integration.test_http_responses import RESPONSES, WEATHER, sdk
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

CONVERSATIONS = "/v1/conversations"


@pytest.fixture
async def api() -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    pipelines = [pipeline_of("echo", tools=True), omni(token_delay_ms=20)]
    async with serving(pipelines, fake_redis_clients(), fast_settings()) as served:
        yield served


def user(text: str) -> Any:
    return {"type": "message", "role": "user", "content": text}


def ids(items: Any) -> list[str]:
    return [str(item.id) for item in items]


def texts(items: Any) -> list[str]:
    """Each message item's text, in the order listed."""
    return ["".join(part.text for part in item.content) for item in items]


async def test_a_conversation_is_made_read_changed_and_deleted(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    oai = sdk(client)
    made = await oai.conversations.create(
        items=[user("one"), user("two"), user("three")], metadata={"topic": "counting"}
    )
    assert made.id.startswith("conv_") and made.metadata == {"topic": "counting"}
    got = await oai.conversations.retrieve(made.id)
    assert (got.id, got.created_at, got.metadata) == (made.id, made.created_at, made.metadata)
    changed = await oai.conversations.update(made.id, metadata={"topic": "numbers"})
    assert changed.metadata == {"topic": "numbers"}
    assert (await oai.conversations.retrieve(made.id)).metadata == {"topic": "numbers"}

    added = await oai.conversations.items.create(made.id, items=[user("four")])
    assert texts(added.data) == ["four"] and ids(added.data)[0].startswith("msg_")
    # paged as OpenAI's: newest first by default, `after` an item's id
    listed = [item async for item in oai.conversations.items.list(made.id, order="asc")]
    assert texts(listed) == ["one", "two", "three", "four"]
    listed_ids = ids(listed)
    assert len(set(listed_ids)) == 4
    newest = await oai.conversations.items.list(made.id, limit=2)
    assert texts(newest.data) == ["four", "three"] and newest.has_more
    rest = await oai.conversations.items.list(made.id, limit=2, after=ids(newest.data)[-1])
    assert texts(rest.data) == ["two", "one"] and not rest.has_more
    one = await oai.conversations.items.retrieve(listed_ids[1], conversation_id=made.id)
    assert texts([one]) == ["two"]

    after_delete = await oai.conversations.items.delete(listed_ids[1], conversation_id=made.id)
    assert after_delete.id == made.id
    left = [item async for item in oai.conversations.items.list(made.id, order="asc")]
    assert texts(left) == ["one", "three", "four"]
    with pytest.raises(openai.NotFoundError):
        await oai.conversations.items.retrieve(listed_ids[1], conversation_id=made.id)
    with pytest.raises(openai.NotFoundError):
        await oai.conversations.items.delete(listed_ids[1], conversation_id=made.id)

    deleted = await oai.conversations.delete(made.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (made.id, True, "conversation.deleted")
    for gone in (
        oai.conversations.retrieve(made.id),
        oai.conversations.delete(made.id),
        oai.conversations.update(made.id, metadata={}),
        oai.conversations.items.list(made.id),
        oai.conversations.items.create(made.id, items=[user("five")]),
    ):
        with pytest.raises(openai.NotFoundError):
            await gone


async def test_responses_in_a_conversation_read_it_and_add_their_turns(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    oai = sdk(client)
    conv = await oai.conversations.create(items=[user("Remember the word banana.")])
    first = await oai.responses.create(
        model="echo", instructions="Be brief.", input="Hi", conversation=conv.id
    )
    assert first.conversation is not None and first.conversation.id == conv.id
    assert turns(first.output_text) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Remember the word banana."},
        {"role": "user", "content": "Hi"},
    ]
    # streamed, naming it as an object: it reads the first response's turn
    stream = await oai.responses.create(
        model="echo", input="And?", conversation={"id": conv.id}, stream=True
    )
    events = [ev async for ev in stream]
    second = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.completed"
    assert [m["content"] for m in turns(second.output_text)] == [
        "Remember the word banana.", "Hi", first.output_text, "And?",
    ]  # fmt: skip
    listed = [item async for item in oai.conversations.items.list(conv.id, order="asc")]
    assert [(item.role, text) for item, text in zip(listed, texts(listed), strict=True)] == [  # type: ignore[union-attr]
        ("user", "Remember the word banana."),
        ("user", "Hi"),
        ("assistant", first.output_text),
        ("user", "And?"),
        ("assistant", second.output_text),
    ]
    # a call and its output are items of the conversation too
    asked = await oai.responses.create(
        model="echo", input="Weather?", tools=[WEATHER], tool_choice="required",
        conversation=conv.id,
    )  # fmt: skip
    (call,) = asked.output
    assert call.type == "function_call"
    output: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "clear"}]
    await oai.responses.create(model="echo", input=output, tools=[WEATHER], conversation=conv.id)
    kinds = [item.type async for item in oai.conversations.items.list(conv.id, order="asc")]
    assert kinds[-4:] == ["message", "function_call", "function_call_output", "message"]
    # a response not kept still adds its turn: the conversation is what the client asked for
    unkept = await oai.responses.create(model="echo", input="Last", store=False,
                                        conversation=conv.id)  # fmt: skip
    newest = await oai.conversations.items.list(conv.id, limit=1)
    assert texts(newest.data) == [unkept.output_text]


async def test_what_a_conversation_cannot_take_is_refused(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, gateway = api
    oai = sdk(client)
    conv = await oai.conversations.create()
    first = await oai.responses.create(model="echo", input="Hi")
    with pytest.raises(openai.BadRequestError) as both:
        await oai.responses.create(
            model="echo", input="Hi", conversation=conv.id, previous_response_id=first.id
        )
    assert both.value.param == "conversation"
    with pytest.raises(openai.NotFoundError) as unknown:
        await oai.responses.create(model="echo", input="Hi", conversation="conv_none")
    assert unknown.value.param == "conversation"
    too_many = {"items": [user(str(k)) for k in range(21)]}
    assert_error(await client.post(CONVERSATIONS, json=too_many), 400)
    assert_error(await client.post(f"{CONVERSATIONS}/{conv.id}/items", json=too_many), 400)
    assert_error(await client.post(f"{CONVERSATIONS}/{conv.id}/items", json={"items": []}), 400)
    long_key = {"metadata": {"k" * 65: "v"}}
    assert_error(await client.post(CONVERSATIONS, json=long_key), 400)
    not_an_item = {"items": [{"type": "image", "url": "x"}]}
    assert_error(await client.post(f"{CONVERSATIONS}/{conv.id}/items", json=not_an_item), 400)
    assert [item async for item in oai.conversations.items.list(conv.id)] == []
    # what Redis holds is read as input is: an item that is garbage is left out, counted
    await oai.conversations.items.create(conv.id, items=[user("kept")])
    assert gateway.conversations is not None
    await gateway.conversations.redis.rpush(gateway.conversations.key(conv.id), b"\x93garbage")
    listed = [item async for item in oai.conversations.items.list(conv.id)]
    assert texts(listed) == ["kept"]
    malformed = gateway.metrics.value("omni_malformed_entries_total", stream="kept conversations")
    assert malformed == 1


async def test_a_conversation_deleted_while_its_response_runs_fails_the_response(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    """Its turn has nowhere to go: the response says so instead of answering as if kept."""
    client, gateway = api
    oai = sdk(client)
    conv = await oai.conversations.create(items=[user("Hello")])
    running = asyncio.create_task(
        oai.responses.create(model="omni", input="Tell me more", conversation=conv.id)
    )
    await wait_for(lambda: gateway.inflight == 1)  # its conversation was read
    await oai.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError) as gone:
        await running
    assert gone.value.param == "conversation"
    assert_error(await client.get(f"{CONVERSATIONS}/{conv.id}"), 404)


async def test_a_conversation_made_on_one_replica_goes_on_on_another() -> None:
    pipelines = [pipeline_of("echo")]
    clients = fake_redis_clients()
    async with serving(pipelines, clients, fast_settings()) as (client, gateway):
        conv = await sdk(client).conversations.create(items=[user("Hi")])
        first = await sdk(client).responses.create(model="echo", input="One", conversation=conv.id)
        other = Gateway(pipelines, gateway.settings, clients, ServeSettings(ready_cache_s=0))
        async with http(create_app(other)) as replica:
            second = await sdk(replica).responses.create(
                model="echo", input="Two", conversation=conv.id
            )
            assert [m["content"] for m in turns(second.output_text)] == [
                "Hi", "One", first.output_text, "Two",
            ]  # fmt: skip
            assert (await replica.get(f"{RESPONSES}/{second.id}")).json()["conversation"] == {
                "id": conv.id
            }
