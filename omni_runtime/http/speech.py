"""POST /v1/audio/speech: the input read aloud, as OpenAI's speech endpoint answers it.

A WAV or FLAC comes whole (their headers say the true sizes, and a failure is still an
error status); raw PCM, MP3 and Opus stream as the audio is made; `stream_format: "sse"`
sends any of them as server-sent `speech.audio.delta` events, then `speech.audio.done`
(or the error that cut the audio)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from omni_runtime.http.audio import (
    MEDIA_TYPES,
    PCM16_RATE,
    EncodedStream,
    Resampler,
    audio_file,
    b64,
    pcm16,
    unencodable,
)
from omni_runtime.http.errors import ApiError, error_json
from omni_runtime.http.events import AudioEvent, Event, FailureEvent
from omni_runtime.http.gateway import Gateway, Run
from omni_runtime.http.prompts import check_prompt, count_tokens, unsupported
from omni_runtime.http.routes import (
    REQUEST_ID_HEADER,
    SSE_HEADERS,
    GuardedStream,
    TraceHeader,
    events_after,
    first_event,
    sse,
    wants,
)
from omni_runtime.http.schemas import RequestModel, ShortStr, Speed, VoiceId, voice_name

SpeechFormat = Literal["wav", "mp3", "flac", "opus", "pcm"]


class SpeechRequest(RequestModel):
    model: ShortStr
    input: Annotated[str, Field(min_length=1, max_length=4096)]
    voice: ShortStr | VoiceId | None = None
    response_format: SpeechFormat = "wav"
    """`pcm`, `mp3` and `opus` stream as they are made; `wav` and `flac` come whole."""
    speed: Speed | None = None
    instructions: Annotated[str, Field(max_length=4096)] | None = None
    """Accepted for compatibility; not passed on."""
    stream_format: Literal["audio", "sse"] = "audio"
    """`sse`: server-sent `speech.audio.delta` events, each a base64 piece of the
    `response_format` audio, then one `speech.audio.done`."""

    def params(self) -> dict[str, Any]:
        given = {"voice": voice_name(self.voice), "speed": self.speed}
        return {k: v for k, v in given.items() if v is not None}


class SpeechAudioDelta(BaseModel):
    type: Literal["speech.audio.delta"] = "speech.audio.delta"
    audio: str
    """Base64: the next piece of the answer's audio, in its `response_format`."""


class SpeechUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class SpeechAudioDone(BaseModel):
    type: Literal["speech.audio.done"] = "speech.audio.done"
    usage: SpeechUsage


def speech_router(gateway: Gateway) -> APIRouter:
    router = APIRouter()

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
        rate = outputs.sample_rate
        # a chat pipeline's stage 0 takes a string as one user turn
        run = await gateway.open(served, req.input, True, wants(x_omni_trace), req.params())
        if req.stream_format == "audio" and (fmt == "wav" or fmt == "flac"):
            try:
                samples = await _whole_audio(run)
            finally:
                run.close()
            data = await asyncio.to_thread(audio_file, samples, rate, fmt)
            headers = {REQUEST_ID_HEADER: run.request_id}
            return Response(data, media_type=MEDIA_TYPES[fmt], headers=headers)
        events = run.events()
        first = await first_event(run, events, audio_only=True)
        failed: list[FailureEvent] = []
        audio = _audio_bytes(events_after(first, events), rate, fmt, failed)
        if req.stream_format == "sse":
            body = _speech_events(run, audio, failed, count_tokens(req.input))
            headers = {**SSE_HEADERS, REQUEST_ID_HEADER: run.request_id}
            return GuardedStream(body, run.close, media_type="text/event-stream", headers=headers)
        headers = {"Cache-Control": "no-cache", REQUEST_ID_HEADER: run.request_id}
        if fmt == "pcm":
            headers["X-Sample-Rate"] = str(PCM16_RATE)
        media_type = "audio/pcm" if fmt == "pcm" else MEDIA_TYPES[fmt]
        return GuardedStream(audio, run.close, media_type=media_type, headers=headers)

    return router


async def _audio_bytes(
    events: AsyncGenerator[Event, None], rate: int, fmt: SpeechFormat, failed: list[FailureEvent]
) -> AsyncGenerator[bytes, None]:
    """The answer in `fmt` as it is made: raw 16-bit PCM at 24 kHz (what OpenAI streams as
    `pcm`), MP3 or Ogg Opus encoded chunk by chunk (on a worker thread: a second of speech
    takes ~3 ms as MP3, ~10 ms as Opus), a WAV or FLAC whole at the end; never an empty
    piece. A failure once the headers went out ends the audio, and is put in `failed`."""
    if fmt == "wav" or fmt == "flac":
        samples = await _all_audio(events, failed)
        if not failed:
            yield await asyncio.to_thread(audio_file, samples, rate, fmt)
        return
    chunks = _audio_of(events, failed)
    if fmt == "pcm":
        resample = Resampler(rate)
        async with aclosing(chunks):
            async for pcm in chunks:
                if data := pcm16(resample(pcm)):
                    yield data
        if tail := pcm16(resample.flush()):
            yield tail
    else:
        stream = EncodedStream(rate, fmt)
        try:
            async with aclosing(chunks):
                async for pcm in chunks:
                    if data := await asyncio.to_thread(stream.encode, pcm):
                        yield data
            if tail := await asyncio.to_thread(stream.close):
                yield tail
        finally:
            stream.close()  # a stream cut short frees its encoder now


async def _audio_of(
    events: AsyncGenerator[Event, None], failed: list[FailureEvent]
) -> AsyncGenerator[npt.NDArray[np.float32], None]:
    """Each audio chunk of `events` (text skipped) until they end or one fails."""
    async with aclosing(events):
        async for ev in events:
            if isinstance(ev, AudioEvent):
                yield ev.pcm
            elif isinstance(ev, FailureEvent):
                failed.append(ev)
                return


async def _speech_events(
    run: Run, audio: AsyncGenerator[bytes, None], failed: list[FailureEvent], input_tokens: int
) -> AsyncIterator[bytes]:
    """OpenAI's `stream_format: "sse"`: a delta per piece of audio, then the usage (the
    model's counts when an engine gave them, else the input's words and no output), or
    the error that ended the audio."""
    async with aclosing(audio):  # cut short, it frees its encoder now
        async for data in audio:
            yield sse(SpeechAudioDelta(audio=b64(data)).model_dump_json())
    if failed:
        yield sse(error_json(failed[0].api_error()).decode())
        return
    given, made = input_tokens, 0
    if run.usage is not None:
        given, made = run.usage.prompt_tokens, run.usage.completion_tokens
    usage = SpeechUsage(input_tokens=given, output_tokens=made, total_tokens=given + made)
    yield sse(SpeechAudioDone(usage=usage).model_dump_json())


async def _whole_audio(run: Run) -> npt.NDArray[np.float32]:
    """Every audio chunk of a request; a failure is an error response."""
    failed: list[FailureEvent] = []
    samples = await _all_audio(run.events(), failed)
    if failed:
        raise failed[0].api_error()
    return samples


async def _all_audio(
    events: AsyncGenerator[Event, None], failed: list[FailureEvent]
) -> npt.NDArray[np.float32]:
    """The audio chunks of `events` as one array (a failure ends them: `_audio_of`)."""
    chunks = _audio_of(events, failed)
    async with aclosing(chunks):
        whole = [pcm async for pcm in chunks]
    return np.concatenate(whole) if whole else np.zeros(0, np.float32)
