"""POST /v1/responses: OpenAI's Responses API (the default of its newer clients and of its
Agents SDK), text out; `GET` and `DELETE /v1/responses/{id}` and
`GET /v1/responses/{id}/input_items` for the responses kept.

The request is read as the chat completion it amounts to (`responses_request`), checked
and run as that chat is (`routes.checked_prompt`); the pipeline's speech is not asked for,
so its TTS stages are not run (`core/types.request_finals`). The answer is one `message`
item of `output_text`, or `function_call` items (each call whole); `status` is
`incomplete` (`incomplete_details.reason: max_output_tokens`) for an answer cut at its
token limit. Streamed (`stream: true`), OpenAI's server-sent events, each with its
`sequence_number`: `response.created`, `response.in_progress`, per item
`response.output_item.added`, its text's `response.content_part.added`,
`response.output_text.delta` per piece, `.output_text.done`, `.content_part.done`, or a
call's `response.function_call_arguments.delta` and `.done`, then
`response.output_item.done`; last `response.completed` (or `response.incomplete`), or
`response.failed` with the error that cut it short.

A response asked with `store` (the default) that completes is kept (`response_store`):
`previous_response_id` continues its conversation, on any replica of the server; one that
failed is not kept. A response that names a `conversation` (`/v1/conversations`) reads its
items before `input`, and when it ends adds its input and output to it; if it cannot
(the conversation was deleted meanwhile, Redis refused), the response fails.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import StreamingResponse

from omni_runtime.core.tool_calls import ToolCall
from omni_runtime.http.errors import ApiError
from omni_runtime.http.events import Event, FailureEvent, TextEvent, ToolCallEvent
from omni_runtime.http.gateway import Gateway, Run
from omni_runtime.http.prompts import count_tokens
from omni_runtime.http.response_store import (
    ConversationStore,
    Kept,
    ResponseStore,
    as_input,
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
from omni_runtime.http.tools import call_id


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
        run = await gateway.open(served, prompt, False, wants(x_omni_trace), req.params(chat))
        kept = store if req.store else None
        answer = Answer(req, run, count_tokens(prompt), kept, history, gateway.conversations)
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
    async def retrieve(response_id: ResponseId) -> dict[str, Any]:
        kept = await kept_responses(gateway).get(response_id)
        if kept is None:
            raise _not_found(response_id)
        return kept.response

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
        if not await kept_responses(gateway).delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


ResponseId = Annotated[str, Path(min_length=1, max_length=256)]
After = Annotated[str | None, Query(min_length=1, max_length=256)]
"""A list's page begins after this item."""
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


def conversation_not_found(conversation_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Conversation with id '{conversation_id}' not found.", param=param,
                    code="not_found")  # fmt: skip


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
    return before.history


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", code="not_found")


class Answer:
    """One response: its output items as they are made, and the body that says them."""

    def __init__(
        self,
        req: ResponsesRequest,
        run: Run,
        prompt_tokens: int,
        store: ResponseStore | None = None,
        history: list[InputItem] | None = None,
        conversations: ConversationStore | None = None,
    ) -> None:
        self.req, self.run, self.prompt_tokens = req, run, prompt_tokens
        self.store, self.history = store, history or []
        """Where it is kept (None: it is not), and the conversation before its input."""
        self.conversations = conversations
        """Where the conversation it names is kept (`req.conversation`)."""
        self.kept = store is not None and store.keeps
        """What its body says as `store`: whether it is kept, once it ended."""
        self.id = f"resp_{run.request_id}"
        self.created_at = int(time.time())
        self.text: list[str] = []
        self.calls: list[ToolCall] = []
        self.items: list[dict[str, Any]] = []
        """The calls' output items, in order (the message joins them when it ends)."""
        self.text_at: int | None = None
        """The message's output index, once its text began."""
        self.seq = 0

    def take(self, ev: Event) -> None:
        """A run's event, whole: its text joins the message, a call is an item."""
        if isinstance(ev, TextEvent):
            self.text_at = len(self.items) if self.text_at is None else self.text_at
            self.text.append(ev.text)
        elif isinstance(ev, ToolCallEvent):
            for call in ev.calls:
                self.items.append(self._call_item(call, "completed"))
                self.calls.append(call)

    def ended_status(self) -> str:
        """The answer ended: its message joins the items (an empty one for an answer of
        nothing); completed, or incomplete at the token limit."""
        if self.text_at is not None or not self.calls:
            at = self.text_at or 0
            self.items.insert(at, self._message(self._message_id(), "".join(self.text)))
        return "incomplete" if self.run.finish_reason == "length" else "completed"

    async def keep(self, status: str) -> None:
        """Add its input and output to the conversation it names (an ApiError if that is
        gone or cannot be written: the response fails); then keep the ended response with
        its conversation, if asked and it can be."""
        own, output = self.req.own_items(), as_input(self.items)
        conversation_id, store = self.req.conversation_id(), self.conversations
        if conversation_id is not None and store is not None:
            added = await store.add(conversation_id, [*own, *output])
            if added is None:
                raise conversation_not_found(conversation_id, param="conversation")
        if self.store is not None and self.kept:
            given = [*self.history, *own]
            history = [*given, *output]
            kept = Kept(response=self.body(status), history=history, inputs=len(given))
            self.kept = await self.store.keep(self.id, kept)

    def body(self, status: str, error: dict[str, str] | None = None) -> dict[str, Any]:
        """The response object, as OpenAI's clients read it."""
        req, done = self.req, status not in ("in_progress", "failed")
        fmt = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if (req.text and req.text.format)
            else {"type": "text"}
        )
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error, "model": req.model,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "output": self.items if done else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": _dumped(req.tool_choice) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": {"format": fmt}, "truncation": req.truncation or "disabled",
            "store": self.kept, "previous_response_id": req.previous_response_id,
            "conversation": {"id": conv} if (conv := req.conversation_id()) else None,
            "metadata": req.metadata, "usage": self._usage() if done else None,
        }  # fmt: skip

    def _usage(self) -> dict[str, Any]:
        """The model's counts when its engine gave them, else the estimates (`routes._usage`)."""
        used = self.run.usage
        given = used.prompt_tokens if used else self.prompt_tokens
        made = used.completion_tokens if used else len(self.text) + len(self.calls)
        cached = used.cached_tokens if used else 0
        return {"input_tokens": given, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": made, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": given + made}  # fmt: skip

    def _message_id(self) -> str:
        return f"msg_{self.run.request_id}"

    def _message(self, item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        content = [_part(text)] if status == "completed" else []
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": content}  # fmt: skip

    def _call_item(
        self, call: ToolCall, status: str, arguments: str | None = None
    ) -> dict[str, Any]:
        k = len(self.calls)
        return {"type": "function_call", "id": f"fc_{self.run.request_id}_{k}",
                "call_id": call_id(self.run.request_id, k), "name": call.name,
                "arguments": call.arguments if arguments is None else arguments,
                "status": status}  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = json.dumps({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return f"event: {kind}\ndata: {body}\n\n".encode()

    async def streamed(self, events: AsyncGenerator[Event, None]) -> AsyncIterator[bytes]:
        """OpenAI's events as the pipeline makes the answer (see the module docstring)."""
        yield self._event("response.created", response=self.body("in_progress"))
        yield self._event("response.in_progress", response=self.body("in_progress"))
        msg = self._message_id()
        place = {"item_id": msg, "content_index": 0}
        async with aclosing(events):
            async for ev in events:
                if isinstance(ev, FailureEvent):
                    error = {"code": ev.code, "message": ev.message}
                    yield self._event("response.failed", response=self.body("failed", error))
                    return
                if isinstance(ev, TextEvent):
                    if (text_at := self.text_at) is None:
                        self.text_at = text_at = len(self.items)
                        item = self._message(msg, "", "in_progress")
                        yield self._event(
                            "response.output_item.added", output_index=text_at, item=item
                        )
                        yield self._event("response.content_part.added", output_index=text_at,
                                          part=_part(""), **place)  # fmt: skip
                    self.text.append(ev.text)
                    yield self._event("response.output_text.delta", output_index=text_at,
                                      delta=ev.text, logprobs=[], **place)  # fmt: skip
                elif isinstance(ev, ToolCallEvent):
                    for call in ev.calls:
                        at = len(self.items) + (self.text_at is not None)
                        item = self._call_item(call, "in_progress", "")
                        yield self._event("response.output_item.added", output_index=at, item=item)
                        yield self._event("response.function_call_arguments.delta",
                                          item_id=item["id"], output_index=at,
                                          delta=call.arguments)  # fmt: skip
                        yield self._event("response.function_call_arguments.done",
                                          item_id=item["id"], output_index=at, name=call.name,
                                          arguments=call.arguments)  # fmt: skip
                        done = self._call_item(call, "completed")
                        self.items.append(done)
                        self.calls.append(call)
                        yield self._event("response.output_item.done", output_index=at, item=done)
        if (text_at := self.text_at) is not None:
            whole = "".join(self.text)
            yield self._event("response.output_text.done", output_index=text_at, text=whole,
                              logprobs=[], **place)  # fmt: skip
            yield self._event("response.content_part.done", output_index=text_at,
                              part=_part(whole), **place)  # fmt: skip
            item = self._message(msg, whole)
            yield self._event("response.output_item.done", output_index=text_at, item=item)
        status = self.ended_status()
        try:
            await self.keep(status)
        except ApiError as e:
            error = {"code": e.body.code or "server_error", "message": e.body.message}
            yield self._event("response.failed", response=self.body("failed", error))
            return
        ended = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self._event(ended, response=self.body(status))


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _dumped(choice: Any) -> Any:
    return choice.model_dump() if hasattr(choice, "model_dump") else choice
