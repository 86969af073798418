"""One `/v1/realtime` response: one runtime request through the pipeline, as Realtime events.

The pipeline's text stage becomes `response.output_text.delta` (text modality) and
`response.output_audio_transcript.delta` (audio modality); its audio stage becomes
`response.output_audio.delta`, resampled with soxr to 24 kHz PCM16 as the protocol
requires; calls of the session's tools become `function_call` items after the message
(each whole: one `response.function_call_arguments.delta`, then its `.done`); an audio-input pipeline's speech-to-text stage (stage 0, when it is final
and neither the text nor the audio stage) becomes the user item's transcript.
A cancel (barge-in, `response.cancel`, disconnect) ends the response at once with
`status: cancelled` and aborts the request at every stage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from omni_runtime.client.client import RequestTimeoutError
from omni_runtime.client.playback import Playback
from omni_runtime.core.tool_calls import ToolCall, calls_in, written_calls, written_result
from omni_runtime.core.types import OrchOutput
from omni_runtime.http.audio import AudioFormatError, as_pcm
from omni_runtime.http.errors import ApiError
from omni_runtime.http.events import FailureEvent
from omni_runtime.http.gateway import Gateway, Run, Served
from omni_runtime.http.realtime_audio import AudioType, OutputEncoder, rate_of
from omni_runtime.http.realtime_events import b64, event, new_id
from omni_runtime.http.schemas import ErrorBody
from omni_runtime.http.sockets import open_shielded
from omni_runtime.http.tools import call_id

log = logging.getLogger(__name__)

Status = Literal["completed", "incomplete", "cancelled", "failed"]


@dataclass
class Item:
    """A conversation item as the session keeps it: the text the thinker reads."""

    id: str
    role: Literal["user", "assistant", "system"]
    text: str = ""
    audio: bytes | None = None
    """Input audio (24 kHz PCM16) not yet heard by a pipeline: only the latest is kept."""
    kind: Literal["text", "audio", "function_call", "function_call_output"] = "text"
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    call_id: str = ""
    name: str = ""
    said: str = ""
    """A call's arguments, or the output a call returned."""
    modalities: tuple[str, ...] = ("audio",)
    """An answer's: its parts (text, then audio), as its response made them."""
    audio_ms: float = 0.0
    """An answer's audio sent, in ms (to `conversation.item.truncate` it)."""
    speaks_all: bool = False
    """An answer's audio says all its text: its response ran to its end (completed, or
    stopped at `max_output_tokens`), not cut short while its text ran ahead."""

    @classmethod
    def call(cls, item_id: str, call_id: str, made: ToolCall) -> Item:
        """A call the assistant made; the thinker reads it as its own JSON."""
        return cls(item_id, "assistant", written_calls([made]), kind="function_call",
                   call_id=call_id, name=made.name, said=made.arguments)  # fmt: skip

    @classmethod
    def result(cls, item_id: str, call_id: str, name: str | None, output: str) -> Item:
        """What a call returned, as the client gave it; the thinker reads it as a user turn."""
        return cls(item_id, "user", written_result(name, output),
                   kind="function_call_output", call_id=call_id, said=output)  # fmt: skip

    def as_dict(self, modalities: list[str] | None = None) -> dict[str, Any]:
        """The item as Realtime events show it (audio is never echoed back)."""
        shown = {"id": self.id, "object": "realtime.item", "type": self.kind,
                 "status": self.status, "call_id": self.call_id}  # fmt: skip
        if self.kind == "function_call":
            return shown | {"name": self.name, "arguments": self.said}
        if self.kind == "function_call_output":
            return shown | {"output": self.said}
        if self.role == "assistant":
            mods = modalities or self.modalities
            parts: list[dict[str, Any]] = []
            if "text" in mods:
                parts.append({"type": "output_text", "text": self.text})
            if "audio" in mods:
                parts.append({"type": "output_audio", "transcript": self.text})
        elif self.kind == "audio":
            parts = [{"type": "input_audio", "transcript": self.text or None}]
        else:
            parts = [{"type": "input_text", "text": self.text}]
        return {"id": self.id, "object": "realtime.item", "type": "message",
                "role": self.role, "status": self.status, "content": parts}  # fmt: skip


@dataclass
class Response:
    """Runs in a task of its own; `cancel` ends it from the session's side at once."""

    gateway: Gateway
    served: Served
    emit: Callable[[dict[str, Any]], None]
    prompt: Any
    params: dict[str, Any]
    modalities: list[str]
    heard: Item | None
    """The user's audio item this response transcribes (an audio-input pipeline)."""
    speech_end: float | None
    """Loop time the user's speech ended (VAD stop or commit): to time the first audio."""
    playback: Playback
    """The session's listener: every response's audio, for gaps within each response."""
    on_done: Callable[[Response, Status], None]
    timeout_s: float
    """How long the request's outputs are waited for (`OMNI_REQUEST_TIMEOUT_S`)."""
    id: str = field(default_factory=lambda: new_id("resp"))
    item: Item = field(default_factory=lambda: Item(new_id("item"), "assistant"))
    status: Status | None = None
    run: Run | None = None
    task: asyncio.Task[None] | None = None
    pieces: int = 0
    later_spoke: bool = False
    """A stage after the speech-to-text one has output (its transcript is due once heard)."""
    output_format: AudioType = "audio/pcm"
    """The session's, when the response started: what its audio deltas carry."""
    calls: list[Item] = field(default_factory=list)
    """The calls of tools it answered with, after its message item."""
    apart: bool = False
    """Out of band (`response.conversation: "none"`): its answer and calls join no
    conversation, and no `conversation.item.*` event says them."""

    def start(self) -> None:
        self.item.status, self.item.modalities = "in_progress", tuple(self.modalities)
        self.emit(event("response.created", response=self._body("in_progress")))
        self.emit(event("response.output_item.added", response_id=self.id, output_index=0,
                        item=self.item.as_dict(self.modalities)))  # fmt: skip
        self._in_conversation("added", self.item.as_dict(self.modalities))
        for index, part in enumerate(self.item.as_dict(self.modalities)["content"]):
            self.emit(event("response.content_part.added", **self._at(index), part=as_part(part)))
        self.task = asyncio.get_running_loop().create_task(self._run(), name=self.id)

    def _in_conversation(self, kind: str, item: dict[str, Any]) -> None:
        """`conversation.item.added` or `.done`, for a response that joins the conversation."""
        if not self.apart:
            self.emit(event(f"conversation.item.{kind}", item=item))

    def _at(self, content_index: int) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0,
                "content_index": content_index}  # fmt: skip

    def _body(self, status: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id, "object": "realtime.response", "status": status,
            "status_details": details, "output_modalities": self.modalities,
            "conversation_id": None, "output": [],
            "audio": {"output": {"format": {"type": self.output_format,
                                            "rate": rate_of(self.output_format)},
                                 "voice": self.params.get("voice")}},
        }  # fmt: skip
        if status != "in_progress":
            body["output"] = [self.item.as_dict(self.modalities)]
            body["output"] += [call.as_dict() for call in self.calls]
            words = len(str(self.prompt).split()) if not isinstance(self.prompt, dict) else 0
            for m in self.prompt.get("messages", []) if isinstance(self.prompt, dict) else []:
                words += len(m["content"].split())
            said, made, cached = words, self.pieces, 0  # estimates, unless the engine counted
            if self.run is not None and (counted := self.run.usage) is not None:
                said, made = counted.prompt_tokens, counted.completion_tokens
                cached = counted.cached_tokens
            body["usage"] = {"input_tokens": said, "output_tokens": made,
                             "total_tokens": said + made,
                             "input_token_details": {"cached_tokens": cached}}  # fmt: skip
        return body

    async def _run(self) -> None:
        audio = "audio" in self.modalities
        try:
            run = self.run = await open_shielded(
                self.gateway, self.served, self.prompt, audio, self.params
            )
        except asyncio.CancelledError:  # closed when it opens (`open_shielded`)
            return
        except ApiError as e:
            self._finish("failed", e.body.model_copy(update={"code": e.body.code or "unavailable"}))
            return
        try:
            failed = await self._stream(run)
        except asyncio.CancelledError:
            return  # `cancel` has finished the response
        finally:
            run.close()
        if failed is not None:
            self._finish("failed", failed.api_error().body)
        elif run.finish_reason == "length":  # the text stopped at `max_output_tokens`
            self._finish("incomplete", reason="max_output_tokens")
        else:
            self._finish("completed")

    async def _stream(self, run: Run) -> FailureEvent | None:
        """Emit the request's outputs as they come; the failure, if one ends it."""
        outs, timer = self.served.outputs, self.gateway.timer
        stt, audio = self.served.pipeline.transcript_stage, "audio" in self.modalities
        encode = OutputEncoder(self.output_format, outs.sample_rate)
        stream = cast(
            AsyncGenerator[OrchOutput, None],
            run.client.stream(run.request_id, self.timeout_s),
        )
        try:
            async with aclosing(stream) as outputs:
                async for out in outputs:
                    run.ended = out.finished
                    timer.output(run.request_id, out.data, out.finished, out.error)
                    if out.error is not None:
                        run.ended = True
                        return FailureEvent.of(out.stage_id, out.error, out.error_code)
                    run.note_end(out)
                    if out.data is None:
                        continue
                    if out.stage_id == stt and self.heard is not None:
                        self.heard.text += str(out.data)
                        if self.later_spoke:
                            self._heard_done()
                    elif out.stage_id == outs.text_stage:
                        self._heard_done()
                        if calls := calls_in(out.data):
                            self._calls(run.request_id, calls)
                        else:
                            self._text(str(out.data))
                    elif out.stage_id == outs.audio_stage and audio:
                        self._heard_done()
                        self._audio(*encode(as_pcm(out.data)))
        except RequestTimeoutError as e:
            return FailureEvent(str(e), 504)
        except AudioFormatError as e:
            return FailureEvent(f"stage {outs.audio_stage}: {e}")
        self._heard_done(ended=True)
        if audio:
            self._audio(*encode.flush())
        return None

    def _heard_done(self, ended: bool = False) -> None:
        """The speech-to-text stage has spoken: a later stage's output came and it has heard
        something, or the response ends. Said once. Stages' outputs are routed apart, so a
        later stage's may come first: an empty transcript then waits for the words."""
        self.later_spoke = True
        heard = self.heard
        if heard is None or self.status is not None or not (ended or heard.text.strip()):
            return
        self.heard = None
        heard.audio, heard.text = None, heard.text.strip()
        self.emit(event("conversation.item.input_audio_transcription.completed",
                        item_id=heard.id, content_index=0, transcript=heard.text,
                        usage={"type": "duration", "seconds": 0}))  # fmt: skip

    def _text(self, piece: str) -> None:
        if not piece or self.status is not None:
            return
        if self.pieces and self.served.outputs.text_separator:
            piece = self.served.outputs.text_separator + piece
        self.pieces += 1
        self.item.text += piece
        audio_index = 1 if "text" in self.modalities else 0
        if "text" in self.modalities:
            self.emit(event("response.output_text.delta", **self._at(0), delta=piece))
        if "audio" in self.modalities:
            self.emit(event("response.output_audio_transcript.delta", **self._at(audio_index),
                            delta=piece))  # fmt: skip

    def _calls(self, request_id: str, calls: list[ToolCall]) -> None:
        """Each call as a `function_call` item of its own, sent whole."""
        for made in calls:
            if self.status is not None:
                return
            item = Item.call(new_id("item"), call_id(request_id, len(self.calls)), made)
            self.calls.append(item)
            at = {"response_id": self.id, "output_index": len(self.calls)}
            started = item.as_dict() | {"status": "in_progress", "arguments": ""}
            self.emit(event("response.output_item.added", **at, item=started))
            self._in_conversation("added", started)
            ids = {**at, "item_id": item.id, "call_id": item.call_id}
            self.emit(event("response.function_call_arguments.delta", **ids, delta=made.arguments))
            self.emit(event("response.function_call_arguments.done", **ids, name=made.name,
                            arguments=made.arguments))  # fmt: skip
            self.emit(event("response.output_item.done", **at, item=item.as_dict()))
            self._in_conversation("done", item.as_dict())

    def _audio(self, coded: bytes, samples: int) -> None:
        """One audio delta: `samples` of audio, coded in the output format."""
        if not samples or self.status is not None:
            return
        now = asyncio.get_running_loop().time()
        if self.speech_end is not None:
            self.gateway.metrics.observe("omni_realtime_speech_to_audio_seconds",
                                         now - self.speech_end)  # fmt: skip
            self.speech_end = None
        self.playback.add(now, samples / rate_of(self.output_format))
        self.item.audio_ms += samples * 1000 / rate_of(self.output_format)
        index = 1 if "text" in self.modalities else 0
        self.emit(event("response.output_audio.delta", **self._at(index), delta=b64(coded)))

    def cancel(self, reason: str) -> None:
        """End it now (`cancelled`) and abort its request at every stage."""
        if self.status is not None:
            return
        self._heard_done()  # the words heard so far, if any, are the user's line
        self._finish("cancelled", reason=reason)
        if self.run is not None:
            self.run.close()
        if self.task is not None:
            self.task.cancel()

    def _finish(
        self, status: Status, error: ErrorBody | None = None, reason: str | None = None
    ) -> None:
        if self.status is not None:
            return
        self.status = status
        self.item.status = "completed" if status == "completed" else "incomplete"
        self.item.speaks_all = status == "completed" or reason == "max_output_tokens"
        index = 0
        if "text" in self.modalities:
            self.emit(event("response.output_text.done", **self._at(0), text=self.item.text))
            index = 1
        if "audio" in self.modalities:
            self.emit(event("response.output_audio.done", **self._at(index)))
            self.emit(event("response.output_audio_transcript.done", **self._at(index),
                            transcript=self.item.text))  # fmt: skip
        item = self.item.as_dict(self.modalities)
        for i, part in enumerate(item["content"]):
            self.emit(event("response.content_part.done", **self._at(i), part=as_part(part)))
        self.emit(event("response.output_item.done", response_id=self.id, output_index=0,
                        item=item))  # fmt: skip
        self._in_conversation("done", item)
        details: dict[str, Any] = {"type": status}
        if reason is not None:
            details["reason"] = reason
        if error is not None:
            details["error"] = {"type": error.type, "code": error.code, "message": error.message}
            log.warning("realtime response %s failed: %s", self.id, error.message)
        self.emit(event("response.done", response=self._body(status, details)))
        self.on_done(self, status)


def as_part(content: dict[str, Any]) -> dict[str, Any]:
    """An item's content as a `response.content_part.*` event says it: its `type` is
    `text` or `audio` there, where the item's is `output_text` or `output_audio`."""
    return content | {"type": content["type"].removeprefix("output_")}
