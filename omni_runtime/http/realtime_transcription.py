"""The turns of a Realtime transcription session (`session.type: "transcription"`): live
captions, as OpenAI's transcription sessions give them.

Each turn of speech the client commits (or server VAD ends) is one runtime request to the
session's pipeline, which must take audio and write text (`workers/transcribe.yaml`; on
a pipeline that also answers, `workers/listen.yaml`, only its speech-to-text stage runs,
as for `/v1/audio/transcriptions`). Its words come as
`conversation.item.input_audio_transcription.delta` events as the stage makes them, then
`.completed` with the whole transcript, or `.failed` with the error; no response is
made. Turns are transcribed at once, each as it is committed, so a turn does not wait
for the one before it to end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from omni_runtime.core.types import FINAL_STAGES_PARAM
from omni_runtime.http.errors import ApiError
from omni_runtime.http.events import FailureEvent, TextEvent
from omni_runtime.http.gateway import Gateway, Run, Served
from omni_runtime.http.realtime_events import event
from omni_runtime.http.realtime_response import Item
from omni_runtime.http.schemas import ErrorBody
from omni_runtime.http.sockets import open_shielded
from omni_runtime.wav import wav_seconds

log = logging.getLogger(__name__)


def check_transcribes(served: Served) -> str | None:
    """Why the pipeline cannot serve a transcription session; None when it can."""
    if served.outputs.input != "audio":
        return f"the model {served.name!r} does not take audio: it cannot transcribe"
    if served.outputs.text_stage is None and served.pipeline.transcript_stage is None:
        return f"the model {served.name!r} writes no text: it cannot transcribe"
    return None


@dataclass(eq=False)
class Transcription:
    """One committed turn's transcription, in a task of its own; `cancel` ends it."""

    gateway: Gateway
    served: Served
    emit: Callable[[dict[str, Any]], None]
    item: Item
    """The user's turn: its text becomes the transcript."""
    wav: bytes
    """Its audio (taken when committed: a later turn's commit drops the item's)."""
    language: str | None
    on_done: Callable[[Transcription], None]
    run: Run | None = None
    task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=self.item.id)

    def cancel(self) -> None:
        if self.run is not None:
            self.run.close()
        if self.task is not None:
            self.task.cancel()

    async def _run(self) -> None:
        try:
            await self._transcribe()
        except asyncio.CancelledError:
            pass
        finally:
            self.on_done(self)

    async def _transcribe(self) -> None:
        params: dict[str, Any] = {} if self.language is None else {"language": self.language}
        heard = self.served.pipeline.transcript_stage  # a pipeline that answers too
        if heard is not None:
            params[FINAL_STAGES_PARAM] = [heard]
        try:
            run = self.run = await open_shielded(
                self.gateway, self.served, {"wav": self.wav}, False, params or None, heard
            )
        except ApiError as e:
            self._failed(e.body)
            return
        pieces: list[str] = []
        try:
            async with aclosing(run.events()) as events:
                async for ev in events:
                    if isinstance(ev, FailureEvent):
                        self._failed(ev.api_error().body)
                        return
                    if isinstance(ev, TextEvent) and ev.text:
                        pieces.append(ev.text)
                        self.emit(event("conversation.item.input_audio_transcription.delta",
                                        item_id=self.item.id, content_index=0,
                                        delta=ev.text))  # fmt: skip
        finally:
            run.close()
        self.item.text, self.item.audio = "".join(pieces).strip(), None
        seconds = wav_seconds(self.wav)
        self.emit(event("conversation.item.input_audio_transcription.completed",
                        item_id=self.item.id, content_index=0, transcript=self.item.text,
                        usage={"type": "duration", "seconds": round(seconds, 3)}))  # fmt: skip

    def _failed(self, error: ErrorBody) -> None:
        log.warning("realtime transcription of %s failed: %s", self.item.id, error.message)
        self.emit(event("conversation.item.input_audio_transcription.failed",
                        item_id=self.item.id, content_index=0,
                        error={"type": error.type, "code": error.code,
                               "message": error.message, "param": error.param}))  # fmt: skip
