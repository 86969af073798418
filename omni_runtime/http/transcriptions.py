"""POST /v1/audio/transcriptions: a multipart upload (WAV, MP3, FLAC or Ogg) → a
speech-to-text pipeline's text.

The form is the one the official `openai` client sends (`file`, `model`, `language`,
`response_format`, …); fields this server has no use for (`prompt`, `temperature`,
`timestamp_granularities[]`, …) are ignored. The pipeline is one whose `outputs.input`
is `audio`: its stage 0 gets `{"wav": <bytes>}` and its text stage's pieces are the answer.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Response, UploadFile
from fastapi.responses import PlainTextResponse

from omni_runtime.http.errors import ApiError
from omni_runtime.http.gateway import FailureEvent, Gateway, TextEvent
from omni_runtime.http.prompts import unsupported
from omni_runtime.http.routes import REQUEST_ID_HEADER, TraceHeader, wants
from omni_runtime.http.schemas import Transcription
from omni_runtime.wav import WavError, recording

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
        response_format: Annotated[Literal["json", "text"], Form()] = "json",
        stream: Annotated[bool, Form()] = False,
        x_omni_trace: TraceHeader = None,
    ) -> Transcription | PlainTextResponse:
        served = gateway.model(model)
        if served.outputs.input != "audio":
            raise unsupported(served, "does not take audio")
        if served.outputs.text_stage is None:
            raise unsupported(served, "has no text output")
        if stream:
            raise ApiError(400, "streamed transcriptions are not supported", param="stream")
        try:
            wav = await asyncio.to_thread(recording, await file.read())  # off the loop
        except WavError as e:
            raise ApiError(400, f"file: {e}", param="file", code="invalid_audio") from None
        finally:
            await file.close()
        params = {"language": language} if language is not None else None
        run = await gateway.open(served, {"wav": wav}, False, wants(x_omni_trace), params)
        try:
            pieces: list[str] = []
            async with aclosing(run.events()) as events:
                async for ev in events:
                    if isinstance(ev, TextEvent):
                        pieces.append(ev.text)
                    elif isinstance(ev, FailureEvent):
                        raise ev.api_error()
        finally:
            run.close()
        text = "".join(pieces)
        if response_format == "text":
            return PlainTextResponse(text, headers={REQUEST_ID_HEADER: run.request_id})
        response.headers[REQUEST_ID_HEADER] = run.request_id
        return Transcription(text=text)

    return router
