"""One Responses API response as it is made (`responses.py` runs it): its output items,
the body that says them, and OpenAI's server-sent events that stream them (each with its
`sequence_number`): `response.created`, `response.in_progress`, per item
`response.output_item.added`, its text's `response.content_part.added`,
`response.output_text.delta` per piece, `.output_text.done`, `.content_part.done`, or a
call's `response.function_call_arguments.delta` and `.done`, then
`response.output_item.done`; last `response.completed` (or `response.incomplete`), or
`response.failed` with the error that cut it short (a background response cancelled
meanwhile: its status `cancelled`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi.responses import StreamingResponse

from omni_runtime.core.tool_calls import ToolCall
from omni_runtime.http import background
from omni_runtime.http.errors import ApiError
from omni_runtime.http.events import Event, FailureEvent, TextEvent, ToolCallEvent
from omni_runtime.http.gateway import Gateway, Run
from omni_runtime.http.response_store import (
    ConversationStore,
    Kept,
    ResponseStore,
    as_input,
    conversation_not_found,
)
from omni_runtime.http.responses_request import InputItem, ResponsesRequest
from omni_runtime.http.routes import REQUEST_ID_HEADER, SSE_HEADERS
from omni_runtime.http.tools import call_id

Opener = Callable[[str], Awaitable[Run]]
"""Submits a queued background response under its request id (`Gateway.open`'s `queued`)."""


class Answer:
    """One response: its output items as they are made, and the body that says them."""

    def __init__(
        self,
        req: ResponsesRequest,
        request_id: str,
        prompt_tokens: int,
        store: ResponseStore | None = None,
        history: list[InputItem] | None = None,
        conversations: ConversationStore | None = None,
    ) -> None:
        self.req, self.request_id, self.prompt_tokens = req, request_id, prompt_tokens
        self._run: Run | None = None
        self.store, self.history = store, history or []
        """Where it is kept (None: it is not), and the conversation before its input."""
        self.conversations = conversations
        """Where the conversation it names is kept (`req.conversation`)."""
        self.kept = store is not None and store.keeps
        """What its body says as `store`: whether it is kept, once it ended."""
        self.id = f"resp_{request_id}"
        self.created_at = int(time.time())
        self.text: list[str] = []
        self.calls: list[ToolCall] = []
        self.items: list[dict[str, Any]] = []
        """The calls' output items, in order (the message joins them when it ends)."""
        self.text_at: int | None = None
        """The message's output index, once its text began."""
        self.seq = 0
        self.ending: background.Ending | None = None
        """A background response's: whether this run is the one that ends it."""

    @property
    def run(self) -> Run:
        """Its request as submitted (a queued background response has none yet)."""
        if self._run is None:
            raise RuntimeError(f"{self.id} is queued: it has no run yet")
        return self._run

    @run.setter
    def run(self, run: Run) -> None:
        self._run = run

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
        if self.ending is not None and not await self.ending.ends(status):
            raise ApiError(409, "the response was ended meanwhile", code="ended")
        own, output = self.req.own_items(), as_input(self.items)
        conversation_id, store = self.req.conversation_id(), self.conversations
        if conversation_id is not None and store is not None:
            added = await store.add(conversation_id, [*own, *output])
            if added is None:
                raise conversation_not_found(conversation_id, param="conversation")
        if self.store is not None and self.kept:
            given = [*self.history, *own]
            history = [*given, *output]
            kept = Kept(response=self.body(status), history=history, inputs=len(given),
                        events=self.streams_again)  # fmt: skip
            self.kept = await self.store.keep(self.id, kept)

    @property
    def streams_again(self) -> bool:
        """Its events are kept for clients to read again (`background` and `stream`)."""
        return bool(self.req.background and self.req.stream)

    def _given(self, status: str, error: dict[str, str] | None = None) -> Kept:
        """It kept as it stands, its input only: begun, or ended with no output."""
        given = [*self.history, *self.req.own_items()]
        return Kept(response=self.body(status, error), history=given, inputs=len(given),
                    events=self.streams_again)  # fmt: skip

    async def in_background(
        self, gateway: Gateway, state: background.BackgroundState
    ) -> dict[str, Any] | StreamingResponse:
        """Run on without the client: kept `in_progress` first (a 503, the run let go, if
        it cannot be), then its body (or, streamed, its events as they are kept)."""
        try:
            await state.begin(self.id, self._given("in_progress"))
        except ApiError:
            self.run.close()
            raise
        return self._on(gateway, state, self._running(), "in_progress")

    async def queued(
        self, gateway: Gateway, state: background.BackgroundState, opener: Opener
    ) -> dict[str, Any] | StreamingResponse:
        """Every place taken (`max_inflight`): kept `queued`, and run on this server (which
        holds its lease meanwhile) once a place frees; as many as `max_inflight` wait at
        most (a 429 past that). `opener` submits it under its id."""
        background.enqueue(gateway, self.id)
        try:
            await state.begin(self.id, self._given("queued"))
        except ApiError:
            background.dequeue(gateway, self.id)
            raise
        return self._on(gateway, state, self._later(gateway, state, opener), "queued")

    def _on(
        self,
        gateway: Gateway,
        state: background.BackgroundState,
        events: AsyncIterator[bytes],
        status: str,
    ) -> dict[str, Any] | StreamingResponse:
        """Its run begun on without its client: its body as it stands, or its events."""
        self.ending = background.Ending(state, self.id)
        stream = self.streams_again
        background.begin_run(gateway, state, self.id, events, stream)
        if stream:
            headers = {**SSE_HEADERS, REQUEST_ID_HEADER: self.request_id}
            return background.followed(gateway, state, self.id, -1, headers)
        return self.body(status)

    async def _running(self) -> AsyncGenerator[bytes, None]:
        """Its events as its run makes them; the run closed when they end (or are let go)."""
        try:
            async with aclosing(self.streamed(self.run.events())) as events:
                async for event in events:
                    yield event
        finally:
            self.run.close()

    async def _later(
        self, gateway: Gateway, state: background.BackgroundState, opener: Opener
    ) -> AsyncIterator[bytes]:
        """A queued response's events: created and queued, then as any once it runs; failed
        with what stopped it if it cannot begin, cancelled if it was meanwhile."""
        run: Run | None = None
        error: dict[str, str] | None = None
        try:
            yield self._event("response.created", response=self.body("queued"))
            yield self._event("response.queued", response=self.body("queued"))
            run = await background.placed(gateway, state, self.id, self.request_id, opener)
        except ApiError as e:
            error = {"code": e.body.code or "server_error", "message": e.body.message}
        finally:
            background.dequeue(gateway, self.id)
        if error is not None:
            yield await self._failed(error)
            return
        if run is None:  # cancelled or deleted while it waited: who did wrote its end
            yield await self._failed(background.ended_error("cancelled"))
            return
        self.run = run
        await background.begun(state, self.id, self._given("in_progress"))
        async with aclosing(self._running()) as events:
            async for event in events:
                yield event

    async def _failed(self, error: dict[str, str]) -> bytes:
        """Its `response.failed` event. It is kept as it ended, its id having been given
        (`response.created`): failed with its error, or a background one cancelled by
        another (who keeps that)."""
        status, writes = "failed", self.kept
        if self.ending is not None:
            status, error, writes = await self.ending.failed(error)
        if writes and self.store is not None:
            self.kept = await self.store.keep(self.id, self._given(status, error))
        return self._event("response.failed", response=self.body(status, error))

    def body(self, status: str, error: dict[str, str] | None = None) -> dict[str, Any]:
        """The response object, as OpenAI's clients read it."""
        req, done = self.req, status in ("completed", "incomplete")
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
            "background": bool(req.background),
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
        return f"msg_{self.request_id}"

    def _message(self, item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        content = [_part(text)] if status == "completed" else []
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": content}  # fmt: skip

    def _call_item(
        self, call: ToolCall, status: str, arguments: str | None = None
    ) -> dict[str, Any]:
        k = len(self.calls)
        return {"type": "function_call", "id": f"fc_{self.request_id}_{k}",
                "call_id": call_id(self.request_id, k), "name": call.name,
                "arguments": call.arguments if arguments is None else arguments,
                "status": status}  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return background.sse(kind, self.seq - 1, **fields)

    async def streamed(self, events: AsyncGenerator[Event, None]) -> AsyncGenerator[bytes, None]:
        """OpenAI's events as the pipeline makes the answer (see the module docstring)."""
        if self.seq == 0:  # a queued one said it was created
            yield self._event("response.created", response=self.body("in_progress"))
        yield self._event("response.in_progress", response=self.body("in_progress"))
        msg = self._message_id()
        place = {"item_id": msg, "content_index": 0}
        async with aclosing(events):
            async for ev in events:
                if isinstance(ev, FailureEvent):
                    yield await self._failed({"code": ev.code, "message": ev.message})
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
            yield await self._failed(
                {"code": e.body.code or "server_error", "message": e.body.message}
            )
            return
        ended = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self._event(ended, response=self.body(status))


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _dumped(choice: Any) -> Any:
    return choice.model_dump() if hasattr(choice, "model_dump") else choice
