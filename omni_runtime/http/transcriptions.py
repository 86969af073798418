"""POST /v1/audio/transcriptions: a multipart upload (WAV, MP3, FLAC or Ogg) → a
speech-to-text pipeline's text.

The form is the one the official `openai` client sends (`file`, `model`, `language`,
`response_format`, `timestamp_granularities[]`, `stream`, …); fields this server has no
use for (`prompt`, `temperature`, …) are ignored. The pipeline is one whose `outputs.input`
is `audio`: its stage 0 gets `{"wav": <bytes>}` and its text stage's pieces are the answer;
`verbose_json`, `srt` and `vtt` ask it for their times (`transcripts`). One that also
answers what it heard (`workers/listen.yaml`) gives its speech-to-text stage's words
(`transcript_stage`), and runs no stage after it for the request (`final_stages`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Response, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from omni_runtime.core.types import FINAL_STAGES_PARAM
from omni_runtime.http.errors import ApiError, error_json
from omni_runtime.http.events import Event, FailureEvent, TextEvent
from omni_runtime.http.gateway import Gateway, Run
from omni_runtime.http.prompts import unsupported
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
from omni_runtime.http.transcripts import (
    Granularity,
    TimedFormat,
    TimedText,
    Transcription,
    TranscriptTextDelta,
    TranscriptTextDone,
    TranscriptUsage,
    cues,
    segments_of,
    verbose_json,
)
from omni_runtime.wav import WavError, recording, wav_seconds

PATH = "/v1/audio/transcriptions"
"""Its body limit is `max_upload_bytes` (`BodyLimit`'s per-path limit), not `max_body_bytes`."""


def transcriptions_router(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    @router.post("/audio/transcriptions", response_model=None)
    async def transcriptions(
        response: Response,
        file: Annotated[UploadFile, File(description="a WAV, MP3, FLAC or Ogg file")],
        model: Annotated[str, Form(min_length=1, max_length=256)],
        language: Annotated[str | None, Form(min_length=1, max_length=32)] = None,
        response_format: Annotated[Literal["json", "text"] | TimedFormat, Form()] = "json",
        timestamp_granularities: Annotated[
            list[Granularity] | None, Form(alias="timestamp_granularities[]", max_length=2)
        ] = None,
        stream: Annotated[bool, Form()] = False,
        x_omni_trace: TraceHeader = None,
    ) -> Transcription | PlainTextResponse | StreamingResponse | JSONResponse:
        served = gateway.model(model)
        if served.outputs.input != "audio":
            raise unsupported(served, "does not take audio")
        if served.outputs.text_stage is None:
            raise unsupported(served, "has no text output")
        timed = response_format not in ("json", "text")
        if timestamp_granularities and response_format != "verbose_json":
            raise ApiError(400, "timestamp_granularities needs response_format verbose_json",
                           param="timestamp_granularities", code="invalid_value")  # fmt: skip
        if stream and timed:
            raise ApiError(400, f"response_format {response_format} cannot be streamed",
                           param="stream", code="invalid_value")  # fmt: skip
        try:
            wav = await asyncio.to_thread(recording, await file.read())  # off the loop
        except WavError as e:
            raise ApiError(400, f"file: {e}", param="file", code="invalid_audio") from None
        finally:
            await file.close()
        params: dict[str, Any] = {} if language is None else {"language": language}
        granularities: list[Granularity] = sorted(set(timestamp_granularities or ["segment"]))
        if timed:  # subtitles are cut into cues at their words
            params["timestamps"] = (
                granularities if response_format == "verbose_json" else ["segment", "word"]
            )
        if (heard := served.pipeline.transcript_stage) is not None:  # it answers too: not here
            params[FINAL_STAGES_PARAM] = [heard]
        trace = wants(x_omni_trace)
        run = await gateway.open(served, {"wav": wav}, False, trace, params or None, heard)
        if stream:
            events = run.events()
            first = await first_event(run, events)
            headers = {**SSE_HEADERS, REQUEST_ID_HEADER: run.request_id}
            body = _transcript_events(run, events_after(first, events))
            return GuardedStream(body, run.close, media_type="text/event-stream", headers=headers)
        try:
            pieces: list[tuple[str, TimedText | None]] = []
            async with aclosing(run.events()) as events:
                async for ev in events:
                    if isinstance(ev, TextEvent):
                        pieces.append((ev.text, ev.timing))
                    elif isinstance(ev, FailureEvent):
                        raise ev.api_error()
        finally:
            run.close()
        headers = {REQUEST_ID_HEADER: run.request_id}
        if (
            response_format == "verbose_json"
            or response_format == "srt"
            or response_format == "vtt"
        ):
            duration = wav_seconds(wav)
            segments = segments_of(pieces, duration)
            if response_format == "verbose_json":
                timed_body = verbose_json(segments, duration, granularities, language)
                return JSONResponse(timed_body, headers=headers)
            kind = "text/vtt" if response_format == "vtt" else "application/x-subrip"
            subtitles = cues(segments, response_format)
            return PlainTextResponse(subtitles, media_type=kind, headers=headers)
        text = "".join(text for text, _timing in pieces)
        if response_format == "text":
            return PlainTextResponse(text, headers=headers)
        response.headers[REQUEST_ID_HEADER] = run.request_id
        return Transcription(text=text)

    return router


async def _transcript_events(run: Run, events: AsyncGenerator[Event, None]) -> AsyncIterator[bytes]:
    """`stream=true`, as OpenAI streams a transcription: a `transcript.text.delta` per
    piece of text, then `transcript.text.done` with the whole (and the usage, when the
    engine counted its tokens), or the error that cut it short."""
    pieces: list[str] = []
    async with aclosing(events):
        async for ev in events:
            if isinstance(ev, TextEvent):
                pieces.append(ev.text)
                if ev.text:
                    yield sse(TranscriptTextDelta(delta=ev.text).model_dump_json())
            elif isinstance(ev, FailureEvent):
                yield sse(error_json(ev.api_error()).decode())
                return
    usage = None
    if run.usage is not None:
        given, made = run.usage.prompt_tokens, run.usage.completion_tokens
        usage = TranscriptUsage(input_tokens=given, output_tokens=made, total_tokens=given + made)
    done = TranscriptTextDone(text="".join(pieces), usage=usage)
    yield sse(done.model_dump_json(exclude_none=True))
