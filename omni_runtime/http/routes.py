"""POST /v1/chat/completions and /v1/audio/speech: pipeline events → OpenAI responses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Annotated

import numpy as np
import numpy.typing as npt
from fastapi import APIRouter, Header, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from omni_runtime.core.types import FinishReason
from omni_runtime.http.audio import (
    MEDIA_TYPES,
    PCM16_RATE,
    EncodedStream,
    Resampler,
    StreamFormat,
    audio_file,
    b64,
    pcm16,
    resampled,
    unencodable,
)
from omni_runtime.http.errors import ApiError, error_json
from omni_runtime.http.gateway import (
    AudioEvent,
    Event,
    FailureEvent,
    Gateway,
    Run,
    TextEvent,
)
from omni_runtime.http.prompts import chat_prompt, check_prompt, count_tokens, unsupported
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
        if served.outputs.input == "audio":  # decoding a recording takes a while: not here
            prompt = await asyncio.to_thread(chat_prompt, gateway, served, req)
        else:
            prompt = chat_prompt(gateway, served, req)
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
        fmt = req.response_format
        if fmt != "pcm" and (why := unencodable(fmt)) is not None:
            raise ApiError(400, why, param="response_format")
        # a chat pipeline's stage 0 takes a string as one user turn
        run = await gateway.open(served, req.input, True, wants(x_omni_trace), req.params())
        if fmt == "wav" or fmt == "flac":  # whole: their headers say the true sizes
            try:
                samples = await _whole_audio(run)
            finally:
                run.close()
            headers = {REQUEST_ID_HEADER: run.request_id}
            data = await asyncio.to_thread(audio_file, samples, outputs.sample_rate, fmt)
            return Response(data, media_type=MEDIA_TYPES[fmt], headers=headers)
        events = run.events()
        first = await _first_event(run, events, audio_only=True)
        headers = {"Cache-Control": "no-cache", REQUEST_ID_HEADER: run.request_id}
        if fmt == "pcm":
            headers["X-Sample-Rate"] = str(PCM16_RATE)
            body = _pcm_stream(first, events, outputs.sample_rate)
            return GuardedStream(body, run.close, media_type="audio/pcm", headers=headers)
        body = _encoded_stream(first, events, outputs.sample_rate, fmt)
        return GuardedStream(body, run.close, media_type=MEDIA_TYPES[fmt], headers=headers)

    return router


async def _audio_after(
    first: Event | None, events: AsyncGenerator[Event, None]
) -> AsyncGenerator[npt.NDArray[np.float32], None]:
    """The speech endpoint's audio: `first`, then each chunk of `events` (text skipped)
    until they end; a failure once the headers went out just ends the audio."""
    async with aclosing(_after(first, events)) as all_events:
        async for ev in all_events:
            if isinstance(ev, AudioEvent):
                yield ev.pcm
            elif isinstance(ev, FailureEvent):
                return


async def _pcm_stream(
    first: Event | None, events: AsyncGenerator[Event, None], rate: int
) -> AsyncIterator[bytes]:
    """Raw 16-bit PCM at 24 kHz, as produced: what OpenAI streams as `pcm`."""
    resample = Resampler(rate)
    async with aclosing(_audio_after(first, events)) as audio:
        async for pcm in audio:
            yield pcm16(resample(pcm))
    yield pcm16(resample.flush())


async def _encoded_stream(
    first: Event | None, events: AsyncGenerator[Event, None], rate: int, fmt: StreamFormat
) -> AsyncIterator[bytes]:
    """An MP3 or Ogg Opus stream, encoded chunk by chunk as the audio comes (on a worker
    thread: a second of speech takes ~3 ms as MP3, ~10 ms as Opus)."""
    stream = EncodedStream(rate, fmt)
    try:
        async with aclosing(_audio_after(first, events)) as audio:
            async for pcm in audio:
                if data := await asyncio.to_thread(stream.encode, pcm):
                    yield data
        yield await asyncio.to_thread(stream.close)
    finally:
        stream.close()  # a stream cut short frees its encoder now


async def _whole_audio(run: Run) -> npt.NDArray[np.float32]:
    """Every audio chunk of a request; a failure is an error response."""
    chunks: list[npt.NDArray[np.float32]] = []
    async with aclosing(run.events()) as events:
        async for ev in events:
            if isinstance(ev, AudioEvent):
                chunks.append(ev.pcm)
            elif isinstance(ev, FailureEvent):
                raise ev.api_error()
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


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
    if run.usage is not None:
        prompt_tokens, pieces = run.usage.prompt_tokens, run.usage.completion_tokens
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=pieces, total_tokens=prompt_tokens + pieces
    )
