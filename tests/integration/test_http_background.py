"""Background responses (`background: true`) with the official `openai` client over the
HTTP path (in-process clusters on fakeredis): answered at once and polled to their end,
cancelled and deleted from another replica, a streamed one read again from any event on
another replica, and one whose server stopped reads as failed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from omni_runtime.http.app import create_app
from omni_runtime.http.background import STOPPED
from omni_runtime.http.gateway import Gateway
from omni_runtime.http.settings import ServeSettings
from tests.integration.http_support import (
    PROMPT,
    PROMPT_TEXT,
    assert_error,
    fake_redis_clients,
    fast_settings,
    http,
    omni,
    pipeline_of,
    serving,
)
from tests.integration.test_http_responses import RESPONSES, sdk
from tests.waiting import wait_for, wait_for_async

pytestmark = pytest.mark.timeout(60)

LONG = " ".join(f"w{k}" for k in range(80))
"""A prompt the slow omni demo takes ~4 s to say (80 tokens at 50 ms)."""
SHORT = " ".join(f"w{k}" for k in range(16))


@pytest.fixture
async def replicas() -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway]]:
    """Two servers of one deployment: the first runs the responses, the second only reads
    and cancels them."""
    pipelines = [pipeline_of("echo"), omni(token_delay_ms=50)]
    clients = fake_redis_clients()
    async with serving(pipelines, clients, fast_settings()) as (client, gateway):
        other = Gateway(pipelines, gateway.settings, clients, ServeSettings(ready_cache_s=0))
        async with http(create_app(other)) as replica:
            yield client, replica, gateway


async def status_of(client: httpx.AsyncClient, response_id: str) -> dict[str, Any]:
    resp = await client.get(f"{RESPONSES}/{response_id}")
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


async def ended(client: httpx.AsyncClient, response_id: str) -> dict[str, Any]:
    """The response once it is no longer in progress."""
    seen: dict[str, Any] = {}

    async def done() -> bool:
        seen.update(await status_of(client, response_id))
        return seen["status"] not in ("queued", "in_progress")

    await wait_for_async(done, explain=lambda: f"still {seen.get('status')}", every_s=0.005)
    return seen


async def test_a_background_response_answers_at_once_and_is_polled_to_its_end(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, gateway = replicas
    begun = await sdk(client).responses.create(model="omni", input=PROMPT, background=True)
    assert begun.status == "in_progress" and begun.background is True
    assert begun.output == [] and begun.usage is None
    polled = await sdk(replica).responses.retrieve(begun.id)
    assert polled.id == begun.id and polled.status in ("in_progress", "completed")
    done = await ended(replica, begun.id)
    assert done["status"] == "completed" and done["background"] is True
    assert done["output"][0]["content"][0]["text"] == PROMPT_TEXT
    assert done["usage"]["output_tokens"] > 0
    await wait_for(lambda: gateway.inflight == 0 and not gateway.background)
    follow = await sdk(replica).responses.create(
        model="omni", input="And?", previous_response_id=begun.id
    )
    assert follow.status == "completed"


async def test_a_background_response_is_cancelled_from_another_replica(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, gateway = replicas
    begun = await sdk(client).responses.create(model="omni", input=LONG, background=True)
    follow = {"model": "omni", "input": "And?", "previous_response_id": begun.id}
    assert_error(await client.post(RESPONSES, json=follow), 400, "previous_response_id")
    cancelled = await sdk(replica).responses.cancel(begun.id)
    assert cancelled.status == "cancelled" and cancelled.output == []
    await wait_for(lambda: gateway.inflight == 0 and not gateway.background, deadline_s=10)
    # the run ended well before its ~4 s, and its end did not write over the cancel
    assert (await status_of(client, begun.id))["status"] == "cancelled"
    again = await sdk(client).responses.cancel(begun.id)
    assert again.status == "cancelled"
    assert gateway.metrics.value("omni_responses_unkept_total") == 0


async def test_what_cannot_be_cancelled_says_why(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, _gateway = replicas
    done = await sdk(client).responses.create(model="echo", input="Hi", background=True)
    assert (await ended(replica, done.id))["status"] == "completed"
    error = assert_error(await replica.post(f"{RESPONSES}/{done.id}/cancel"), 400)
    assert "completed" in error["message"], error
    plain = await sdk(client).responses.create(model="echo", input="Hi")
    error = assert_error(await replica.post(f"{RESPONSES}/{plain.id}/cancel"), 400)
    assert "background" in error["message"], error
    assert_error(await replica.post(f"{RESPONSES}/resp_nothing/cancel"), 404)
    again = f"{RESPONSES}/{plain.id}?stream=true"
    assert_error(await replica.get(again), 400, "stream")


async def test_a_background_response_deleted_while_it_runs_stays_deleted(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, gateway = replicas
    begun = await sdk(client).responses.create(model="omni", input=LONG, background=True)
    deleted = await replica.delete(f"{RESPONSES}/{begun.id}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
    await wait_for(lambda: gateway.inflight == 0 and not gateway.background, deadline_s=10)
    assert_error(await client.get(f"{RESPONSES}/{begun.id}"), 404)


async def test_a_streamed_background_response_is_read_again_from_any_event(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, gateway = replicas
    first: list[Any] = []
    stream = await sdk(client).responses.create(
        model="omni", input=SHORT, background=True, stream=True
    )
    async for ev in stream:
        first.append(ev)
        if len(first) == 6:
            break  # the client goes away; the response runs on
    await stream.close()
    assert [ev.sequence_number for ev in first] == list(range(6))
    response_id = first[0].response.id
    assert first[0].type == "response.created" and first[0].response.background is True
    rest = [
        ev
        async for ev in await sdk(replica).responses.retrieve(
            response_id, stream=True, starting_after=first[-1].sequence_number
        )
    ]
    assert [ev.sequence_number for ev in rest] == list(range(6, 6 + len(rest)))
    assert rest[-1].type == "response.completed"
    deltas = [ev.delta for ev in first + rest if ev.type == "response.output_text.delta"]
    whole = rest[-1].response.output_text
    assert "".join(deltas) == whole and whole.split() == SHORT.split()
    again = [ev async for ev in await sdk(replica).responses.retrieve(response_id, stream=True)]
    assert [ev.sequence_number for ev in again] == list(range(6 + len(rest)))
    await wait_for(lambda: gateway.inflight == 0 and not gateway.background)


async def test_a_streamed_background_response_cancelled_ends_its_readers(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    """(The in-process transport hands the client its events once the stream ends: the
    cancel comes from another task, once the response has said a few words.)"""
    client, replica, gateway = replicas
    redis = gateway.clients.aio()

    async def cancel_midway() -> None:
        keys: list[str] = []

        async def saying() -> bool:
            found = await redis.keys("*:background:*:events")
            keys[:] = [k.decode() if isinstance(k, bytes) else k for k in found]
            return bool(keys) and await redis.xlen(keys[0]) > 8

        await wait_for_async(saying)
        response_id = keys[0].split(":")[-2]
        await sdk(replica).responses.cancel(response_id)

    canceller = asyncio.create_task(cancel_midway())
    stream = await sdk(client).responses.create(
        model="omni", input=LONG, background=True, stream=True
    )
    seen = [ev async for ev in stream]
    await canceller
    last = seen[-1]
    assert last.type == "response.failed" and last.response.status == "cancelled"
    deltas = [ev for ev in seen if ev.type == "response.output_text.delta"]
    assert 4 < len(deltas) < len(LONG.split()), "it ran to its end"
    assert (await status_of(client, last.response.id))["status"] == "cancelled"
    await redis.aclose()


async def test_a_background_response_whose_server_stopped_reads_as_failed(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, gateway = replicas
    begun = await sdk(client).responses.create(model="omni", input=LONG, background=True)
    for task in list(gateway.background):  # its run stops: its lease goes, as when its
        task.cancel()  # server dies and the lease lapses
    await wait_for(lambda: not gateway.background)
    failed = await ended(replica, begun.id)
    assert failed["status"] == "failed" and failed["error"] == STOPPED
    error = assert_error(await replica.post(f"{RESPONSES}/{begun.id}/cancel"), 400)
    assert "failed" in error["message"], error


async def test_a_background_response_needs_a_server_that_keeps_responses() -> None:
    settings = fast_settings().model_copy(update={"responses_ttl_s": 0})
    async with serving([pipeline_of("echo")], fake_redis_clients(), settings) as (client, _):
        body = {"model": "echo", "input": "Hi", "background": True}
        assert_error(await client.post(RESPONSES, json=body), 400, "background")


async def test_a_background_response_whose_conversation_went_is_kept_failed(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, _gateway = replicas
    conversation = await sdk(client).conversations.create()
    begun = await sdk(client).responses.create(
        model="omni", input=SHORT, background=True, conversation=conversation.id
    )
    await sdk(replica).conversations.delete(conversation.id)
    failed = await ended(replica, begun.id)
    assert failed["status"] == "failed" and failed["error"]["code"] == "not_found", failed


async def test_readers_of_background_responses_are_bounded_and_counted_out(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, _replica, gateway = replicas
    stream = await sdk(client).responses.create(
        model="echo", input="Hi", background=True, stream=True
    )
    events: list[Any] = [ev async for ev in stream]
    response_id = events[0].response.id
    assert gateway.followers == 0
    again = [ev async for ev in await sdk(client).responses.retrieve(response_id, stream=True)]
    assert again[-1].type == "response.completed" and gateway.followers == 0
    gateway.followers = gateway.serve.max_inflight  # every reader's place taken
    error = assert_error(await client.get(f"{RESPONSES}/{response_id}?stream=true"), 429)
    assert error["code"] == "busy", error
    gateway.followers = 0


@pytest.fixture
async def one_place() -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway]]:
    """A server that runs one request at a time (`max_inflight` 1), and a replica."""
    pipelines = [pipeline_of("echo"), omni(token_delay_ms=50)]
    clients = fake_redis_clients()
    async with serving(pipelines, clients, fast_settings(), max_inflight=1) as (client, gateway):
        other = Gateway(pipelines, gateway.settings, clients, ServeSettings(ready_cache_s=0))
        async with http(create_app(other)) as replica:
            yield client, replica, gateway


async def one_behind(client: httpx.AsyncClient, first: str, second: str) -> tuple[Any, Any]:
    """Two background responses on a server with one place: the first runs, the second
    waits (`queued`)."""
    running = await sdk(client).responses.create(model="omni", input=first, background=True)
    waiting = await sdk(client).responses.create(model="omni", input=second, background=True)
    assert running.status == "in_progress" and waiting.status == "queued", (running, waiting)
    return running, waiting


async def test_background_responses_past_max_inflight_are_queued_and_run_in_turn(
    one_place: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, gateway = one_place
    running, waiting = await one_behind(client, SHORT, PROMPT)
    assert waiting.background is True and waiting.output == []
    assert gateway.metrics.gauge("omni_background_queued") == 1
    polled = await status_of(replica, waiting.id)
    assert polled["status"] in ("queued", "in_progress", "completed"), polled
    body = {"model": "omni", "input": "Hi", "background": True}  # the queue is full too
    assert assert_error(await client.post(RESPONSES, json=body), 429)["code"] == "busy"
    plain = {"model": "omni", "input": "Hi"}  # one that would wait for its answer is refused
    assert_error(await client.post(RESPONSES, json=plain), 429)
    first, second = await ended(replica, running.id), await ended(replica, waiting.id)
    assert first["status"] == second["status"] == "completed", (first, second)
    assert first["output"][0]["content"][0]["text"].split() == SHORT.split()
    assert second["output"][0]["content"][0]["text"] == PROMPT_TEXT
    await wait_for(lambda: gateway.inflight == 0 and not (gateway.queued or gateway.background))
    assert gateway.metrics.gauge("omni_background_queued") == 0


async def test_a_queued_response_cancelled_never_runs(
    one_place: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, gateway = one_place
    running, waiting = await one_behind(client, LONG, SHORT)
    cancelled = await sdk(replica).responses.cancel(waiting.id)
    assert cancelled.status == "cancelled" and cancelled.output == []
    await wait_for(lambda: not gateway.queued, deadline_s=10)  # it left the queue
    assert gateway.inflight == 1  # the one running still is, and alone
    instead = await sdk(client).responses.create(model="omni", input=SHORT, background=True)
    assert instead.status == "queued"
    here = await sdk(client).responses.cancel(instead.id)  # on its own server: its place is
    assert here.status == "cancelled" and not gateway.queued  # free at once
    await sdk(replica).responses.cancel(running.id)
    await wait_for(lambda: gateway.inflight == 0 and not gateway.background, deadline_s=10)
    assert (await status_of(replica, waiting.id))["status"] == "cancelled"
    assert gateway.metrics.value("omni_requests_received_total") == 1  # neither was submitted
    deleted_too, queued = await one_behind(client, LONG, SHORT)
    assert (await replica.delete(f"{RESPONSES}/{queued.id}")).status_code == 200
    await sdk(replica).responses.cancel(deleted_too.id)
    await wait_for(lambda: not (gateway.queued or gateway.background), deadline_s=10)
    assert_error(await client.get(f"{RESPONSES}/{queued.id}"), 404)


async def test_a_streamed_queued_response_says_it_waits_then_streams_as_any(
    one_place: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, gateway = one_place
    await sdk(client).responses.create(model="omni", input=SHORT, background=True)
    stream = await sdk(client).responses.create(
        model="omni", input=PROMPT, background=True, stream=True
    )
    events: list[Any] = [ev async for ev in stream]
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    kinds = [ev.type for ev in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"], kinds
    assert events[0].response.status == events[1].response.status == "queued"
    assert events[2].response.status == "in_progress" and kinds.count("response.created") == 1
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == PROMPT_TEXT
    response_id = events[0].response.id
    again: list[Any] = [
        ev async for ev in await sdk(replica).responses.retrieve(response_id, stream=True)
    ]
    assert [ev.type for ev in again] == kinds
    await wait_for(lambda: gateway.inflight == 0 and not (gateway.queued or gateway.background))


async def test_a_draining_server_runs_the_responses_it_queued(
    one_place: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, gateway = one_place
    running, waiting = await one_behind(client, SHORT, PROMPT)
    gateway.stop()  # the drain begins: nothing new, what was taken runs
    body = {"model": "omni", "input": "Hi", "background": True}
    assert assert_error(await client.post(RESPONSES, json=body), 503)["code"] == "shutting_down"
    await wait_for(lambda: not gateway.background, deadline_s=15)
    assert (await status_of(replica, running.id))["status"] == "completed"
    assert (await status_of(replica, waiting.id))["status"] == "completed"


async def test_a_drain_that_runs_out_fails_the_responses_still_queued(
    one_place: tuple[httpx.AsyncClient, httpx.AsyncClient, Gateway],
) -> None:
    client, replica, gateway = one_place
    running, waiting = await one_behind(client, LONG, SHORT)
    gateway.stop()
    assert gateway.cut_all() == 1  # the drain ran out: the one running is cut
    await wait_for(lambda: not gateway.background, deadline_s=10)
    for response_id in (running.id, waiting.id):
        failed = await status_of(replica, response_id)
        assert failed["status"] == "failed", failed
        assert failed["error"]["code"] == "shutting_down", failed
    assert gateway.metrics.value("omni_requests_received_total") == 1  # it never began
