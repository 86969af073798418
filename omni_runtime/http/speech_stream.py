"""`/v1/audio/speech/stream`: text in as it is written (an LLM's tokens), speech out as it is
made, over one WebSocket; the message names are vLLM-Omni's.

`/v1/audio/speech` needs the whole input before it speaks; an agent whose text comes from
a model token by token would wait for all of it. Here the text is cut into clauses as it
arrives (`core.clauses.ClauseCutter`, as the voice pipeline's talker cuts its
thinker's tokens: the first piece short, so the first audio comes early) and each piece
is a request of its own, submitted as soon as it is complete, up to `AHEAD` of them
made while the one before is sent; their audio goes out in order.

Client → server: `session.config` (`voice`, `speed`, `response_format` `pcm`,
`stream_audio`; between utterances only), `input.text` (`text`), `input.done` (the
utterance's text is complete: its last piece is spoken, then `session.done`; the session
stays open for the next) and `session.close` (what was given is spoken, then the socket
closes). Server → client, per piece: `audio.start` (`utterance_index`, `sentence_index`,
`sentence_text`, `format`, `sample_rate`), its audio as binary frames of 16-bit PCM at
24 kHz (one per piece, or each chunk as made with `stream_audio`), `audio.done`
(`total_bytes`, `error`); per utterance `session.done` (`total_sentences`); `error`
(`message`, `code`) for a message refused or a piece that failed, the session going on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from omni_runtime.core.clauses import DEFAULT_FIRST_CLAUSE_CHARS, ClauseCutter
from omni_runtime.errors import in_words
from omni_runtime.http.audio import PCM16_RATE, Resampler, pcm16
from omni_runtime.http.errors import ApiError
from omni_runtime.http.events import AudioEvent, FailureEvent
from omni_runtime.http.gateway import Gateway, Run, Served
from omni_runtime.http.prompts import unsupported
from omni_runtime.http.schemas import ShortStr, Speed, VoiceId, voice_name
from omni_runtime.http.sockets import (
    KEY_PROTOCOL,
    Connection,
    KeyCheck,
    Message,
    OriginCheck,
    RealtimeSettings,
    admit,
    offered_key,
    open_shielded,
    refuse,
)

log = logging.getLogger(__name__)

PATH = "/v1/audio/speech/stream"
AHEAD = 2
"""Pieces made while the one before them is sent: the next is ready when it ends."""
MAX_WAITING_CHARS = 65_536
"""Text given but not yet spoken; past it an `input.text` is refused (a client writing far
faster than speech, for minutes)."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # other servers' fields change nothing here


class SessionConfig(_Message):
    type: Literal["session.config"]
    model: ShortStr | None = None
    voice: ShortStr | VoiceId | None = None
    speed: Speed | None = None
    response_format: Literal["pcm"] = "pcm"
    stream_audio: bool = False


class InputText(_Message):
    type: Literal["input.text"]
    text: str


class InputDone(_Message):
    type: Literal["input.done"]


class SessionClose(_Message):
    type: Literal["session.close"]


AnyMessage = Annotated[
    SessionConfig | InputText | InputDone | SessionClose, Field(discriminator="type")
]
CLIENT_MESSAGE: TypeAdapter[AnyMessage] = TypeAdapter(AnyMessage)


def stream_error(message: str, code: str, server: bool = False) -> dict[str, Any]:
    return {"type": "error", "message": message, "code": code}


@dataclass
class Piece:
    utterance: int
    index: int
    text: str
    params: dict[str, Any]
    stream_audio: bool
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    run: Run | None = None
    refused: ApiError | None = None


@dataclass
class UtteranceEnd:
    utterance: int
    pieces: int


def speech_stream_router(
    gateway: Gateway, check_key: KeyCheck, check_origin: OriginCheck, settings: RealtimeSettings
) -> APIRouter:
    router = APIRouter()

    @router.websocket(PATH)
    async def speech_stream(websocket: WebSocket, model: str | None = None) -> None:
        if (cross_site := check_origin(websocket.headers)) is not None:
            await refuse(websocket, cross_site, stream_error)
            return
        offered, authorization = offered_key(websocket)
        keyed = next((p for p in offered if p.startswith(KEY_PROTOCOL)), None)
        try:
            await check_key(authorization)
            served = speaker(gateway, model)
            admit(gateway, settings)
        except ApiError as e:
            await refuse(websocket, e, stream_error)
            return

        def session(emit: Callable[[Message], None], wake: Callable[[], None]) -> SpeechStream:
            return SpeechStream(gateway, served, emit, wake)

        await Connection(gateway, websocket, settings, session).serve(keyed)

    return router


def speaker(gateway: Gateway, model: str | None) -> Served:
    """The pipeline `?model=` names, which must read its input aloud; without one, the
    first served that does."""
    if model is not None:
        served = gateway.model(model)
        outs = served.outputs
        if outs.audio_stage is None or outs.input != "text" or not outs.speaks_input:
            raise unsupported(served, "does not read text aloud")
        return served
    for served in gateway.served.values():
        outs = served.outputs
        if outs.audio_stage is not None and outs.input == "text" and outs.speaks_input:
            return served
    raise ApiError(404, "no pipeline served here reads text aloud", code="model_not_found")


class SpeechStream:
    """One connection's utterances (`sockets.SocketSession`): pieces cut from the text,
    made ahead, sent in order."""

    def __init__(
        self,
        gateway: Gateway,
        served: Served,
        emit: Callable[[Message], None],
        wake: Callable[[], None],
    ) -> None:
        self.gateway, self.served, self.emit, self.wake = gateway, served, emit, wake
        self.config = SessionConfig(type="session.config")
        self.cutter: ClauseCutter | None = None
        """The open utterance's, from its first text to its `input.done`."""
        self.utterance = 0
        self.pieces = 0
        """Pieces of the open utterance so far."""
        self.todo: deque[Piece | UtteranceEnd] = deque()
        self.waiting_chars = 0
        self.closing = False
        self.speaking: Piece | None = None
        self._more = asyncio.Event()
        """Pieces came, or one was spoken: the opener looks again."""
        self._queued = asyncio.Event()
        """Something was queued: the speaker looks again."""
        self._tasks: list[asyncio.Task[None]] = []

    # --- the connection's side (`sockets.SocketSession`) ---------------------------------

    @property
    def busy(self) -> bool:
        """Pieces to speak (an utterance still being written, with none, idles: the idle
        timeout bounds a client gone silent mid-utterance, and the drain ends it)."""
        return bool(self.todo) or self.speaking is not None

    @property
    def finished(self) -> bool:
        return self.closing and not self.todo and self.speaking is None

    def start(self) -> None:
        """The opener and the speaker start; the client speaks first."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(task()) for task in (self._open_ahead, self._speak)]

    def error(self, message: str, code: str, server: bool = False) -> dict[str, Any]:
        return stream_error(message, code, server)

    def take(self, raw: str | bytes) -> None:
        if self.closing:
            self.emit(stream_error("the session is closing", "session_closing"))
            return
        try:
            message = CLIENT_MESSAGE.validate_json(raw)
        except ValidationError as e:
            self.emit(stream_error(f"invalid message: {in_words(e)}", "invalid_message"))
            return
        if isinstance(message, SessionConfig):
            self._configure(message)
        elif isinstance(message, InputText):
            self._write(message.text)
        else:
            if self.cutter is not None or isinstance(message, InputDone):
                self._end_utterance()
            self.closing = isinstance(message, SessionClose)
            self.wake()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for item in (self.speaking, *self.todo):
            if isinstance(item, Piece) and item.run is not None:
                item.run.close()  # aborted at every stage, unless it ended
        self.todo.clear()

    # --- client messages ----------------------------------------------------------------

    def _configure(self, config: SessionConfig) -> None:
        if self.cutter is not None:
            self.emit(stream_error("session.config comes between utterances (after "
                                   "input.done), not while text is given", "utterance_open"))  # fmt: skip
        elif config.model is not None and config.model != self.served.name:
            self.emit(stream_error(f"this session speaks with {self.served.name!r} (the "
                                   "model it was opened with: ?model=)", "model_fixed"))  # fmt: skip
        else:
            self.config = config

    def _write(self, text: str) -> None:
        if self.waiting_chars + len(text) > MAX_WAITING_CHARS:
            self.emit(stream_error(f"more than {MAX_WAITING_CHARS} characters wait to be "
                                   "spoken: this text is dropped", "too_far_ahead"))  # fmt: skip
            return
        if self.cutter is None:
            self.cutter = ClauseCutter(first_clause_chars=DEFAULT_FIRST_CLAUSE_CHARS)
        self._queue(self.cutter.feed(text))

    def _end_utterance(self) -> None:
        if self.cutter is not None:
            self._queue(self.cutter.flush())
        self.todo.append(UtteranceEnd(self.utterance, self.pieces))
        self.cutter, self.utterance, self.pieces = None, self.utterance + 1, 0
        self._queued.set()

    def _queue(self, pieces: list[str]) -> None:
        params: dict[str, Any] = {
            "voice": voice_name(self.config.voice),
            "speed": self.config.speed,
        }
        params = {k: v for k, v in params.items() if v is not None}
        params["first_clause_chars"] = 0  # cut already: the talker makes no shorter piece
        for text in pieces:
            if not text.strip():  # nothing to say (the cutter keeps every space)
                continue
            self.todo.append(Piece(self.utterance, self.pieces, text, params,
                                   self.config.stream_audio))  # fmt: skip
            self.pieces += 1
            self.waiting_chars += len(text)
        self._more.set()
        self._queued.set()

    # --- the pieces' requests -------------------------------------------------------------

    async def _open_ahead(self) -> None:
        """Submit the piece being sent and the `AHEAD` after it, each once it is queued:
        the next is made while one plays."""
        while True:
            await self._more.wait()
            self._more.clear()
            coming = [item for item in (self.speaking, *self.todo) if isinstance(item, Piece)]
            for piece in coming[: AHEAD + 1]:
                if piece.opened.is_set():
                    continue
                try:  # the session closing meanwhile aborts it once open
                    piece.run = await open_shielded(
                        self.gateway, self.served, piece.text, True, piece.params
                    )
                except ApiError as e:  # busy, not ready, draining: this piece fails
                    piece.refused = e
                except Exception as e:  # a piece can fail only itself, never the session
                    log.exception("a speech stream's piece could not be submitted")
                    piece.refused = ApiError(502, f"could not submit: {e!r}", code="unavailable")
                piece.opened.set()

    async def _speak(self) -> None:
        while True:
            while not self.todo:
                self._queued.clear()
                await self._queued.wait()
            item = self.todo.popleft()
            if isinstance(item, UtteranceEnd):
                self.emit({"type": "session.done", "utterance_index": item.utterance,
                           "total_sentences": item.pieces})  # fmt: skip
                self.wake()
                continue
            self.speaking = item
            self._more.set()  # one more may open now
            try:
                await item.opened.wait()
                await self._say(item)
            finally:
                if item.run is not None:
                    item.run.close()
                self.waiting_chars -= len(item.text)
                self.speaking = None
                self._more.set()
                self.wake()  # the drain and `finished` look again

    async def _say(self, piece: Piece) -> None:
        """One piece: `audio.start`, its audio, `audio.done` (an `error` first if it failed)."""
        where = {"utterance_index": piece.utterance, "sentence_index": piece.index}
        self.emit({"type": "audio.start", **where, "sentence_text": piece.text,
                   "format": "pcm", "sample_rate": PCM16_RATE})  # fmt: skip
        sent, failure = 0, piece.refused
        if piece.run is not None:
            resample, whole = Resampler(self.served.outputs.sample_rate), bytearray()
            async with aclosing(piece.run.events()) as events:
                async for ev in events:
                    if isinstance(ev, FailureEvent):
                        failure = ev.api_error()
                        break
                    if isinstance(ev, AudioEvent) and (data := pcm16(resample(ev.pcm))):
                        sent += self._send(data, whole, piece.stream_audio)
            if failure is None and (tail := pcm16(resample.flush())):
                sent += self._send(tail, whole, piece.stream_audio)
            if whole:
                self.emit(bytes(whole))
        if failure is not None:
            body = failure.body
            self.emit(stream_error(body.message, body.code or "pipeline_error"))
        self.emit({"type": "audio.done", **where, "total_bytes": sent,
                   "error": failure is not None})  # fmt: skip

    def _send(self, data: bytes, whole: bytearray, now: bool) -> int:
        if now:
            self.emit(data)
        else:
            whole += data
        return len(data)
