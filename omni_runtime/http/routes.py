"""POST /v1/chat/completions: pipeline events → OpenAI responses, and what the other
endpoints stream with (`GuardedStream`, the first event awaited before the headers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Header, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from omni_runtime.core.types import FinishReason
from omni_runtime.http.audio import (
    Resampler,
    audio_file,
    b64,
    pcm16,
    resampled,
    unencodable,
)
from omni_runtime.http.errors import ApiError, error_json
from omni_runtime.http.events import AudioEvent, Event, FailureEvent, TextEvent, ToolCallEvent
from omni_runtime.http.gateway import Gateway, Run, Served
from omni_runtime.http.prompts import chat_prompt, count_tokens
from omni_runtime.http.schemas import (
    AssistantMessage,
    AudioDelta,
    AudioOut,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    PromptTokensDetails,
    Usage,
)
from omni_runtime.http.tools import call_deltas, calls_out

AUDIO_EXPIRY_S = 3600
"""`expires_at` is reported as OpenAI does; this server keeps no audio to refer back to."""

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
REQUEST_ID_HEADER = "X-Omni-Request-Id"
"""Every pipeline response names its request: what `omni-runtime trace ID` takes."""
TraceHeader = Annotated[str | None, Header(description="1: record this request's timeline")]
"""`X-Omni-Trace: 1` traces one request in every process, with tracing off."""


def wants(flag: str | None) -> bool:
    """A header's yes: 1, true, yes, on (any case)."""
    return flag is not None and flag.strip().lower() in {"1", "true", "yes", "on"}


class GuardedStream(StreamingResponse):
    """A streaming response that always runs `on_close`: normal end, error or disconnect.

    Starlette cancels the body when the client disconnects; the generator's own
    `finally` may then never run (it may be suspended at a `yield`), this does.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], None],
        media_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def chat_router(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    @router.post("/chat/completions", response_model=None)
    async def chat(
        req: ChatCompletionRequest, response: Response, x_omni_trace: TraceHeader = None
    ) -> ChatCompletion | StreamingResponse:
        served = gateway.model(req.model)
        prompt = await checked_prompt(gateway, served, req)
        prompt_tokens = count_tokens(prompt)
        if req.wants_audio and served.outputs.audio_stage is None:
            raise ApiError(400, "this pipeline has no audio output", param="modalities")
        if not req.wants_audio and served.outputs.text_stage is None:
            raise ApiError(400, "this pipeline has no text output", param="modalities")
        fmt = req.audio.format if req.audio else "wav"
        if req.wants_audio and fmt != "pcm16" and (cannot := unencodable(fmt)) is not None:
            raise ApiError(400, cannot, param="audio.format")
        run = await gateway.open(served, prompt, req.wants_audio, wants(x_omni_trace), req.params())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = run.events()
            first = await first_event(run, events)
            return GuardedStream(
                _chat_sse(
                    run, events_after(first, events), req.model, include_usage, prompt_tokens
                ),
                run.close,
                media_type="text/event-stream",
                headers={**SSE_HEADERS, REQUEST_ID_HEADER: run.request_id},
            )
        response.headers[REQUEST_ID_HEADER] = run.request_id
        try:
            return await _chat_whole(run, req, served.outputs.sample_rate, prompt_tokens)
        finally:
            run.close()

    return router


async def checked_prompt(gateway: Gateway, served: Served, req: ChatCompletionRequest) -> Any:
    """What stage 0 takes for the chat, once what it asks was checked against what the
    pipeline does (a 400 naming the field if not): no JSON answers, or no tools, from a
    pipeline that makes none; not both at once."""
    refused = req.refused()
    if refused is not None:
        param, why = refused
        raise ApiError(400, why, param=param, code="unsupported_parameter")
    shaped = req.response_format is not None and req.response_format.type != "text"
    if shaped and not served.outputs.structured:
        raise ApiError(
            400, f"pipeline {served.name!r} does not shape its answers as JSON "
            "(its outputs.structured is false): response_format must be 'text'",
            param="response_format", code="unsupported_parameter",
        )  # fmt: skip
    if req.calls_tools and not served.outputs.tools:
        raise ApiError(
            400, f"pipeline {served.name!r} calls no tools (its outputs.tools is false): "
            "send no tools, or tool_choice 'none'",
            param="tools", code="unsupported_parameter",
        )  # fmt: skip
    if req.calls_tools and shaped:
        raise ApiError(
            400, "an answer shaped by response_format calls no tools: send one or the other",
            param="response_format", code="unsupported_parameter",
        )  # fmt: skip
    if served.outputs.input == "audio":  # decoding a recording takes a while: not here
        return await asyncio.to_thread(chat_prompt, gateway, served, req)
    return chat_prompt(gateway, served, req)


async def first_event(
    run: Run, events: AsyncGenerator[Event, None], audio_only: bool = False
) -> Event | None:
    """The run's first event (its first audio, text skipped, if `audio_only`), awaited
    before a streamed response's headers, so that a failure is still a proper error
    response (raised as its `ApiError`). The run is closed if the wait fails, is cancelled,
    or ends in a failure."""
    waited = False
    try:
        first = await (_next_audio(events) if audio_only else anext(events, None))
        waited = True
    finally:
        if not waited:
            run.close()
    if isinstance(first, FailureEvent):
        run.close()
        raise first.api_error()
    return first


async def _next_audio(events: AsyncGenerator[Event, None]) -> AudioEvent | FailureEvent | None:
    """Skips text: the speech endpoint only speaks."""
    async for ev in events:
        if isinstance(ev, AudioEvent | FailureEvent):
            return ev
    return None


def sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


async def events_after(
    first: Event | None, events: AsyncGenerator[Event, None]
) -> AsyncGenerator[Event, None]:
    """`first`, then the rest of `events` (closed when this is)."""
    async with aclosing(events):
        if first is None:
            return
        yield first
        async for ev in events:
            yield ev


async def _chat_sse(
    run: Run,
    events: AsyncGenerator[Event, None],
    model: str,
    include_usage: bool,
    prompt_tokens: int,
) -> AsyncIterator[bytes]:
    """chat.completion.chunk events as the pipeline produces them, then `[DONE]`."""
    cid, audio_id, created = (
        f"chatcmpl-{run.request_id}",
        f"audio_{run.request_id}",
        int(time.time()),
    )

    def chunk(delta: Delta, finish: FinishReason | None = None) -> bytes:
        choice = ChunkChoice(delta=delta, finish_reason=finish)
        body = ChatCompletionChunk(id=cid, created=created, model=model, choices=[choice])
        return sse(body.model_dump_json(exclude_none=True))

    yield chunk(Delta(role="assistant", content=""))
    pieces = 0
    resample = Resampler(run.served.outputs.sample_rate)  # pcm16 is 24 kHz, as OpenAI's
    async with aclosing(events):
        async for ev in events:
            if isinstance(ev, TextEvent):
                pieces += 1
                spoken = AudioDelta(id=audio_id, transcript=ev.text) if run.audio else None
                yield chunk(Delta(content=ev.text, audio=spoken))
            elif isinstance(ev, ToolCallEvent):
                yield chunk(Delta(tool_calls=call_deltas(run.request_id, ev.calls, ev.first)))
            elif isinstance(ev, AudioEvent):
                pcm = resample(ev.pcm)
                if pcm.size:
                    yield chunk(Delta(audio=AudioDelta(id=audio_id, data=b64(pcm16(pcm)))))
            else:
                err = ev.api_error()
                yield sse(error_json(err).decode())
                return
    tail = resample.flush()
    if run.audio and tail.size:
        yield chunk(Delta(audio=AudioDelta(id=audio_id, data=b64(pcm16(tail)))))
    expiry = AudioDelta(id=audio_id, expires_at=int(time.time()) + AUDIO_EXPIRY_S)
    yield chunk(Delta(audio=expiry if run.audio else None), finish=run.finish_reason)
    if include_usage:
        usage = _usage(run, prompt_tokens, pieces)
        body = ChatCompletionChunk(id=cid, created=created, model=model, choices=[], usage=usage)
        yield sse(body.model_dump_json(exclude_none=True))
    yield sse("[DONE]")


async def _chat_whole(
    run: Run, req: ChatCompletionRequest, rate: int, prompt_tokens: int
) -> ChatCompletion:
    text: list[str] = []
    audio: list[np.ndarray] = []
    message = AssistantMessage(content=None)
    async with aclosing(run.events()) as events:
        async for ev in events:
            if isinstance(ev, TextEvent):
                text.append(ev.text)
            elif isinstance(ev, ToolCallEvent):
                made = calls_out(run.request_id, ev.calls, ev.first)
                message.tool_calls = [*(message.tool_calls or []), *made]
            elif isinstance(ev, AudioEvent):
                audio.append(ev.pcm)
            else:
                raise ev.api_error()
    content = "".join(text)
    message.content = content if text or not message.tool_calls else None
    if run.audio and message.content is not None:  # an answer of calls only says nothing
        samples = np.concatenate(audio) if audio else np.zeros(0, np.float32)
        fmt = req.audio.format if req.audio else "wav"
        if fmt == "pcm16":  # 24 kHz; a file says its rate
            data = pcm16(resampled(samples, rate))
        else:
            data = await asyncio.to_thread(audio_file, samples, rate, fmt)
        message.audio = AudioOut(
            id=f"audio_{run.request_id}",
            data=b64(data),
            expires_at=int(time.time()) + AUDIO_EXPIRY_S,
            transcript=content,
        )
    return ChatCompletion(
        id=f"chatcmpl-{run.request_id}",
        created=int(time.time()),
        model=req.model,
        choices=[Choice(message=message, finish_reason=run.finish_reason)],
        usage=_usage(run, prompt_tokens, len(text)),
    )


def _usage(run: Run, prompt_tokens: int, pieces: int) -> Usage:
    """The model's token counts when its engine gave them, else the estimates: the prompt's
    words and the text pieces."""
    details = None
    if (used := run.usage) is not None:
        prompt_tokens, pieces = used.prompt_tokens, used.completion_tokens
        details = PromptTokensDetails(cached_tokens=used.cached_tokens)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=pieces,
                 total_tokens=prompt_tokens + pieces, prompt_tokens_details=details)  # fmt: skip
