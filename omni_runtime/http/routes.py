"""POST /v1/chat/completions and /v1/audio/speech: pipeline events → OpenAI responses."""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Header, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from omni_runtime.core.types import FinishReason
from omni_runtime.http.audio import PCM16_RATE, Resampler, b64, pcm16, resampled, wav_bytes
from omni_runtime.http.errors import ApiError, error_json
from omni_runtime.http.gateway import (
    AudioEvent,
    Event,
    FailureEvent,
    Gateway,
    Run,
    Served,
    TextEvent,
)
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
    SpeechRequest,
    Usage,
)
from omni_runtime.wav import WavError, whole_wav

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


def check_prompt(gateway: Gateway, prompt: str, param: str) -> None:
    if not prompt.strip():
        raise ApiError(400, "the prompt is empty", param=param, code="empty_prompt")
    if len(prompt) > gateway.serve.max_prompt_chars:
        raise ApiError(
            400,
            f"the prompt exceeds {gateway.serve.max_prompt_chars} characters",
            param=param,
            code="prompt_too_long",
        )


def unsupported(served: Served, what: str) -> ApiError:
    """A request the model named cannot serve (its pipeline lacks the input or output)."""
    return ApiError(
        400, f"the model {served.name!r} {what}", param="model", code="unsupported_model"
    )


TOKEN = re.compile(r"\w+|[^\w\s]")


def count_tokens(prompt: Any) -> int:
    """`usage.prompt_tokens`: the words and punctuation marks of what stage 0 is given (all
    the messages of a chat), as `completion_tokens` counts the text pieces it answers
    with. The front door has no model's tokenizer: a thinker's own count may differ."""
    if isinstance(prompt, dict):
        return sum(count_tokens(m["content"]) for m in prompt.get("messages", ()))
    return len(TOKEN.findall(str(prompt)))


def chat_prompt(gateway: Gateway, served: Served, req: ChatCompletionRequest) -> Any:
    """The conversation for a pipeline taking chat messages, the last user message for one
    taking text; for one that hears, what `heard_prompt` makes."""
    if served.outputs.input == "audio":
        return heard_prompt(gateway, served, req)
    if any(m.audio() for m in req.messages):
        raise unsupported(served, "takes text, not audio (a model whose pipeline hears does)")
    check_prompt(gateway, req.prompt, "messages")
    if served.outputs.input == "text":
        return req.prompt
    try:
        conversation = req.conversation()
    except ValueError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_value") from None
    check_prompt(gateway, "".join(m["content"] for m in conversation["messages"]), "messages")
    return conversation


def heard_prompt(gateway: Gateway, served: Served, req: ChatCompletionRequest) -> Any:
    """The last user message's speech (one `input_audio` WAV) as a spoken turn, with the
    messages before it (and its own text, as a user message before the speech): what
    `/v1/realtime` sends such a pipeline. Earlier turns are text: none is heard again."""
    last = max(i for i, m in enumerate(req.messages) if m.role == "user")
    param = f"messages.{last}.content"
    spoken = [i for i, m in enumerate(req.messages) if m.audio()]
    if last not in spoken:
        raise ApiError(400, f"the model {served.name!r} takes speech: send it in the last user "
                       "message as an input_audio part (a WAV file), or to "
                       "/v1/audio/transcriptions", param=param)  # fmt: skip
    if spoken != [last]:
        raise ApiError(400, "only the last user message may carry audio: send earlier turns "
                       "as text", param=f"messages.{spoken[0]}.content")  # fmt: skip
    parts = req.messages[last].audio()
    if len(parts) > 1:
        raise ApiError(400, "a message carries one input_audio part", param=param)
    try:
        wav = whole_wav(base64.b64decode(parts[0].data, validate=True))
    except (binascii.Error, WavError) as e:
        why = e if isinstance(e, WavError) else "not base64"
        raise ApiError(400, f"input_audio: {why}", param=param, code="invalid_audio") from None
    try:
        before = req.conversation(before=last + 1)["messages"]
    except ValueError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_value") from None
    history = [m for m in before if m["content"].strip()]
    if history:
        check_prompt(gateway, "".join(m["content"] for m in history), "messages")
    return {"wav": wav, "messages": history} if history else {"wav": wav}


def media_router(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    @router.post("/chat/completions", response_model=None)
    async def chat(
        req: ChatCompletionRequest, response: Response, x_omni_trace: TraceHeader = None
    ) -> ChatCompletion | StreamingResponse:
        served = gateway.model(req.model)
        refused = req.refused()
        if refused is not None:
            param, why = refused
            raise ApiError(400, why, param=param, code="unsupported_parameter")
        prompt = chat_prompt(gateway, served, req)
        prompt_tokens = count_tokens(prompt)
        if req.wants_audio and served.outputs.audio_stage is None:
            raise ApiError(400, "this pipeline has no audio output", param="modalities")
        if not req.wants_audio and served.outputs.text_stage is None:
            raise ApiError(400, "this pipeline has no text output", param="modalities")
        run = await gateway.open(served, prompt, req.wants_audio, wants(x_omni_trace), req.params())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = run.events()
            first = await _first_event(run, events)
            return GuardedStream(
                _chat_sse(run, _after(first, events), req.model, include_usage, prompt_tokens),
                run.close,
                media_type="text/event-stream",
                headers={**SSE_HEADERS, REQUEST_ID_HEADER: run.request_id},
            )
        response.headers[REQUEST_ID_HEADER] = run.request_id
        try:
            return await _chat_whole(run, req, served.outputs.sample_rate, prompt_tokens)
        finally:
            run.close()

    @router.post("/audio/speech", response_model=None)
    async def speech(
        req: SpeechRequest, x_omni_trace: TraceHeader = None
    ) -> Response | StreamingResponse:
        served = gateway.model(req.model)
        check_prompt(gateway, req.input, "input")
        outputs = served.outputs
        if outputs.audio_stage is None:
            raise unsupported(served, "has no audio output")
        if outputs.input == "audio":
            raise unsupported(served, "takes audio, not text")
        if not outputs.speaks_input:
            raise unsupported(served, "answers its input instead of speaking it")
        # a chat pipeline's stage 0 takes a string as one user turn
        run = await gateway.open(served, req.input, True, wants(x_omni_trace), req.params())
        if req.response_format == "wav":  # a file: whole, with its true sizes in the header
            try:
                pcm = await _whole_audio(run)
            finally:
                run.close()
            headers = {"X-Sample-Rate": str(outputs.sample_rate), REQUEST_ID_HEADER: run.request_id}
            return Response(
                wav_bytes(pcm, outputs.sample_rate), media_type="audio/wav", headers=headers
            )
        events = run.events()
        first = await _first_event(run, events, audio_only=True)
        resample = Resampler(outputs.sample_rate)

        async def body() -> AsyncIterator[bytes]:
            """Raw 16-bit PCM at 24 kHz, as produced: what OpenAI streams as `pcm`."""
            if isinstance(first, AudioEvent):
                yield pcm16(resample(first.pcm))
            async with aclosing(events):
                async for ev in events:
                    if isinstance(ev, AudioEvent):
                        yield pcm16(resample(ev.pcm))
                    elif isinstance(ev, FailureEvent):  # headers are sent: the audio just ends
                        return
            yield pcm16(resample.flush())

        headers = {
            "X-Sample-Rate": str(PCM16_RATE),
            "Cache-Control": "no-cache",
            REQUEST_ID_HEADER: run.request_id,
        }
        return GuardedStream(body(), run.close, media_type="audio/pcm", headers=headers)

    return router


async def _whole_audio(run: Run) -> bytes:
    """Every audio chunk of a request as 16-bit PCM; a failure is an error response."""
    chunks: list[bytes] = []
    async with aclosing(run.events()) as events:
        async for ev in events:
            if isinstance(ev, AudioEvent):
                chunks.append(pcm16(ev.pcm))
            elif isinstance(ev, FailureEvent):
                raise ev.api_error()
    return b"".join(chunks)


async def _first_event(
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


def _sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


async def _after(
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
        return _sse(body.model_dump_json(exclude_none=True))

    yield chunk(Delta(role="assistant", content=""))
    pieces = 0
    resample = Resampler(run.served.outputs.sample_rate)  # pcm16 is 24 kHz, as OpenAI's
    async with aclosing(events):
        async for ev in events:
            if isinstance(ev, TextEvent):
                pieces += 1
                spoken = AudioDelta(id=audio_id, transcript=ev.text) if run.audio else None
                yield chunk(Delta(content=ev.text, audio=spoken))
            elif isinstance(ev, AudioEvent):
                pcm = resample(ev.pcm)
                if pcm.size:
                    yield chunk(Delta(audio=AudioDelta(id=audio_id, data=b64(pcm16(pcm)))))
            else:
                err = ev.api_error()
                yield _sse(error_json(err).decode())
                return
    tail = resample.flush()
    if run.audio and tail.size:
        yield chunk(Delta(audio=AudioDelta(id=audio_id, data=b64(pcm16(tail)))))
    expiry = AudioDelta(id=audio_id, expires_at=int(time.time()) + AUDIO_EXPIRY_S)
    yield chunk(Delta(audio=expiry if run.audio else None), finish=run.finish_reason)
    if include_usage:
        usage = _usage(run, prompt_tokens, pieces)
        body = ChatCompletionChunk(id=cid, created=created, model=model, choices=[], usage=usage)
        yield _sse(body.model_dump_json(exclude_none=True))
    yield _sse("[DONE]")


async def _chat_whole(
    run: Run, req: ChatCompletionRequest, rate: int, prompt_tokens: int
) -> ChatCompletion:
    text: list[str] = []
    audio: list[np.ndarray] = []
    async with aclosing(run.events()) as events:
        async for ev in events:
            if isinstance(ev, TextEvent):
                text.append(ev.text)
            elif isinstance(ev, AudioEvent):
                audio.append(ev.pcm)
            else:
                raise ev.api_error()
    content = "".join(text)
    message = AssistantMessage(content=content)
    if run.audio:
        samples = np.concatenate(audio) if audio else np.zeros(0, np.float32)
        fmt = req.audio.format if req.audio else "wav"
        wav = fmt == "wav"  # a WAV file says its rate; raw pcm16 is 24 kHz
        data = wav_bytes(pcm16(samples), rate) if wav else pcm16(resampled(samples, rate))
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
    if run.usage is not None:
        prompt_tokens, pieces = run.usage.prompt_tokens, run.usage.completion_tokens
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=pieces, total_tokens=prompt_tokens + pieces
    )
