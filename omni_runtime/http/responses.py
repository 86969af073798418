"""POST /v1/responses: OpenAI's Responses API (the default of its newer clients and of its
Agents SDK), text out; `GET` and `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items` for the responses kept, and
`POST /v1/responses/{id}/cancel` for the background ones (`background.py`).

The request is read as the chat completion it amounts to (`responses_request`), checked
and run as that chat is (`routes.checked_prompt`); the pipeline's speech is not asked for,
so its TTS stages are not run (`core/types.request_finals`). The answer is one `message`
item of `output_text`, or `function_call` items (each call whole); `status` is
`incomplete` (`incomplete_details.reason: max_output_tokens`) for an answer cut at its
token limit. Streamed (`stream: true`), OpenAI's server-sent events
(`response_answer.py`).

A response asked with `store` (the default) that completes is kept (`response_store`):
`previous_response_id` continues its conversation, on any replica of the server; a
streamed one that failed is kept failed, with its error (a non-streamed one that failed
is an HTTP error, with no response to keep). A response that names a
`conversation` (`/v1/conversations`) reads its items before `input`, and when it ends adds
its input and output to it; if it cannot (the conversation was deleted meanwhile, Redis
refused), the response fails.
"""

from __future__ import annotations

import functools
import uuid
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import StreamingResponse

from omni_runtime.http import background
from omni_runtime.http.errors import ApiError
from omni_runtime.http.events import FailureEvent
from omni_runtime.http.gateway import Gateway
from omni_runtime.http.prompts import count_tokens
from omni_runtime.http.response_answer import Answer
from omni_runtime.http.response_store import (
    ConversationStore,
    Kept,
    ResponseStore,
    conversation_not_found,
    page,
)
from omni_runtime.http.responses_request import InputItem, ResponsesRequest
from omni_runtime.http.routes import (
    REQUEST_ID_HEADER,
    SSE_HEADERS,
    GuardedStream,
    TraceHeader,
    checked_prompt,
    events_after,
    first_event,
    wants,
)


def responses_router(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    @router.post("/responses", response_model=None)
    async def responses(
        req: ResponsesRequest, response: Response, x_omni_trace: TraceHeader = None
    ) -> dict[str, Any] | StreamingResponse:
        if (refused := req.refused()) is not None:
            param, why, code = refused
            raise ApiError(400, why, param=param, code=code)
        served = gateway.model(req.model)
        if served.outputs.text_stage is None:
            raise ApiError(400, "this pipeline has no text output", param="model")
        store = kept_responses(gateway)
        history = await _history(gateway, req)
        chat = req.as_chat(history)
        prompt = await checked_prompt(gateway, served, chat)
        state = background.BackgroundState.of(gateway) if req.background else None
        if state is not None and not store.keeps:
            raise ApiError(400, "this server keeps no responses (OMNI_RESPONSES_TTL_S=0): "
                           "ask without background", param="background", code="invalid_value")  # fmt: skip
        kept, tokens = store if req.store else None, count_tokens(prompt)
        opener = functools.partial(
            gateway.open, served, prompt, False, wants(x_omni_trace), req.params(chat)
        )
        full = gateway.inflight >= gateway.serve.max_inflight
        if state is not None and full and not gateway.stopping:  # (a drain: `open` says so)
            later = Answer(req, uuid.uuid4().hex, tokens, kept, history, gateway.conversations)
            return await later.queued(gateway, state, lambda rid: opener(queued=rid))
        run = await opener()
        answer = Answer(req, run.request_id, tokens, kept, history, gateway.conversations)
        answer.run = run
        if state is not None:
            return await answer.in_background(gateway, state)
        if req.stream:
            events = run.events()
            first = await first_event(run, events)
            return GuardedStream(
                answer.streamed(events_after(first, events)),
                run.close,
                media_type="text/event-stream",
                headers={**SSE_HEADERS, REQUEST_ID_HEADER: run.request_id},
            )
        response.headers[REQUEST_ID_HEADER] = run.request_id
        try:
            async with aclosing(run.events()) as events:
                async for ev in events:
                    if isinstance(ev, FailureEvent):
                        raise ev.api_error()
                    answer.take(ev)
        finally:
            run.close()
        status = answer.ended_status()
        await answer.keep(status)
        return answer.body(status)

    @router.get("/responses/{response_id}", response_model=None)
    async def retrieve(
        response_id: ResponseId, stream: bool = False, starting_after: StartingAfter = None
    ) -> dict[str, Any] | StreamingResponse:
        """The response as it stands; `stream`: a background one's events, from the one
        after `starting_after` (OpenAI's `include_obfuscation` is read as always false)."""
        kept = await kept_responses(gateway).get(response_id)
        if kept is None:
            raise _not_found(response_id)
        state = background.BackgroundState.of(gateway)
        if stream and not kept.events:
            raise ApiError(400, "only a response made with background and stream can be "
                           "streamed again", param="stream", code="invalid_value")  # fmt: skip
        if stream:
            after = -1 if starting_after is None else starting_after
            return background.followed(gateway, state, response_id, after, SSE_HEADERS)
        return await state.shown(kept)

    @router.post("/responses/{response_id}/cancel", response_model=None)
    async def cancel(response_id: ResponseId) -> dict[str, Any]:
        """Stop a background response (on any replica); one cancelled before is as it is."""
        kept = await kept_responses(gateway).get(response_id)
        if kept is None:
            raise _not_found(response_id)
        body = await background.BackgroundState.of(gateway).shown(kept)
        if not body.get("background"):
            raise ApiError(400, "only a background response can be cancelled",
                           param="response_id", code="invalid_value")  # fmt: skip
        if body["status"] in background.RUNNING:
            cancelled = await _stop(gateway, kept, "cancelled")
            body = cancelled or await _current(gateway, response_id)
        if body["status"] != "cancelled":
            raise ApiError(400, f"the response is {body['status']}: only one in progress can "
                           "be cancelled", param="response_id", code="invalid_value")  # fmt: skip
        return body

    @router.get("/responses/{response_id}/input_items", response_model=None)
    async def input_items(
        response_id: ResponseId, after: After = None, limit: Limit = 20, order: Order = "desc"
    ) -> dict[str, Any]:
        kept = await kept_responses(gateway).get(response_id)
        if kept is None:
            raise _not_found(response_id)
        return page(kept.input_items(response_id), after, limit, order, f"response {response_id!r}")

    @router.delete("/responses/{response_id}", response_model=None)
    async def delete(response_id: ResponseId) -> dict[str, Any]:
        """Forget a response; a background one still running is stopped first."""
        kept = await kept_responses(gateway).get(response_id)
        if kept is not None and kept.response.get("status") in background.RUNNING:
            await _stop(gateway, kept, "deleted")
        if not await kept_responses(gateway).delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


ResponseId = Annotated[str, Path(min_length=1, max_length=256)]
After = Annotated[str | None, Query(min_length=1, max_length=256)]
"""A list's page begins after this item."""
StartingAfter = Annotated[int | None, Query(ge=-1, le=1_000_000)]
"""A stream read again begins after this event's sequence number."""
Limit = Annotated[int, Query(ge=1, le=100)]
Order = Literal["asc", "desc"]


def kept_responses(gateway: Gateway) -> ResponseStore:
    if gateway.kept is None:
        raise _not_ready()
    return gateway.kept


def conversations(gateway: Gateway) -> ConversationStore:
    if gateway.conversations is None:
        raise _not_ready()
    return gateway.conversations


async def _stop(gateway: Gateway, kept: Kept, as_status: str) -> dict[str, Any] | None:
    served = gateway.served.get(kept.response.get("model", ""))
    abort = served.client.abort if served is not None and served.client is not None else None
    stopped = await background.stop(background.BackgroundState.of(gateway), kept, as_status, abort)
    background.dequeue(gateway, kept.response["id"])  # if it was queued here
    return stopped


async def _current(gateway: Gateway, response_id: str) -> dict[str, Any]:
    kept = await kept_responses(gateway).get(response_id)
    if kept is None:
        raise _not_found(response_id)
    return await background.BackgroundState.of(gateway).shown(kept)


def _not_ready() -> ApiError:
    return ApiError(503, "not ready: the server is starting", code="not_ready")


async def _history(gateway: Gateway, req: ResponsesRequest) -> list[InputItem]:
    """The items before `input`: those of the conversation the request names (a 404 if
    there is none), or those the response `previous_response_id` holds (a 400 if none is
    kept)."""
    if (conversation_id := req.conversation_id()) is not None:
        held = await conversations(gateway).get(conversation_id)
        if held is None:
            raise conversation_not_found(conversation_id, param="conversation")
        return held.history()
    if (previous_response_id := req.previous_response_id) is None:
        return []
    before = await kept_responses(gateway).get(previous_response_id)
    if before is None:
        raise ApiError(
            400,
            f"Previous response with id '{previous_response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    shown = await background.BackgroundState.of(gateway).shown(before)
    if shown["status"] in background.RUNNING:
        raise ApiError(400, f"Previous response with id '{previous_response_id}' is still "
                       "in progress.", param="previous_response_id", code="invalid_value")  # fmt: skip
    return before.history


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", code="not_found")
