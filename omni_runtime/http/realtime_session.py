"""One `/v1/realtime` session's state: its settings, its conversation, its input audio.

The session holds the conversation (`realtime_conversation`) and hands it to the thinker
with every response:
a pipeline whose `outputs.input` is `chat` gets the message list (the instructions
as its system message); an `audio` one gets the latest spoken turn as a WAV file with
the messages before it (`{"wav", "messages"}`); a `text` one gets the last user
message alone. Server VAD turns appended audio into committed turns and responses,
and speech that starts while a response plays cancels it (barge-in). A pipeline whose
text stage calls tools (`outputs.tools`) gets the session's tools with every response;
the calls it makes, and the outputs the client adds for them, join the conversation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Literal

from omni_runtime.client.playback import Playback
from omni_runtime.http.audio import wav_bytes
from omni_runtime.http.gateway import Gateway, Served
from omni_runtime.http.realtime_audio import AudioType, InputDecoder, described, uncodable
from omni_runtime.http.realtime_conversation import Conversation, item_of
from omni_runtime.http.realtime_events import (
    SAMPLE_RATE,
    AudioConfig,
    BufferAppend,
    BufferClear,
    BufferCommit,
    ClientEvent,
    EventError,
    ItemCreate,
    ItemDelete,
    ItemRetrieve,
    ItemTruncate,
    NamedTool,
    RealtimeTool,
    RealtimeToolChoice,
    ResponseCancel,
    ResponseCreate,
    ServerVad,
    SessionUpdate,
    checked_tools,
    decode_audio,
    event,
    new_id,
    shown_choice,
)
from omni_runtime.http.realtime_response import Item, Response, Status
from omni_runtime.http.realtime_transcription import Transcription, check_transcribes
from omni_runtime.http.sockets import RealtimeSettings
from omni_runtime.http.tools import tool_params
from omni_runtime.http.vad import DEFAULT_PADDING_MS, DEFAULT_SILENCE_MS, VoiceActivity

MIN_COMMIT_MS = 100
BYTES_PER_MS = SAMPLE_RATE * 2 // 1000


class Session:
    """Takes client events (`handle`), emits server events through `emit`."""

    def __init__(
        self,
        gateway: Gateway,
        served: Served,
        settings: RealtimeSettings,
        emit: Callable[[Any], None],
        on_idle: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_idle`: called when a response ends (the server's drain closes the session then)."""
        self.gateway, self.served, self.emit, self.on_idle = gateway, served, emit, on_idle
        self.timeout_s = settings.request_timeout_s
        """A response's wait for its request's outputs (`OMNI_REQUEST_TIMEOUT_S`)."""
        self.id = new_id("sess")
        outs = served.outputs
        self.instructions = ""
        self.modalities: list[str] = ["audio"] if outs.audio_stage is not None else ["text"]
        self.voice: str | None = None
        self.speed: float | None = None
        self.max_tokens: int | None = None
        self.truncation: Literal["auto", "disabled"] = "auto"
        self.tools: list[RealtimeTool] = []
        self.tool_choice: RealtimeToolChoice = "auto"
        """`auto`: a thinker whose context the conversation outgrows drops its oldest turns."""
        self.input_format: AudioType = "audio/pcm"
        self.output_format: AudioType = "audio/pcm"
        self.decode = InputDecoder(self.input_format)
        self.vad_config: ServerVad | None = ServerVad(type="server_vad")
        self.vad = self._new_vad()
        self.conversation = Conversation(emit, gateway.serve.max_prompt_chars)
        self.buffer = bytearray()
        self.max_buffer_bytes = int(settings.realtime_max_buffer_s * 1000) * BYTES_PER_MS
        self.active: Response | None = None
        self.pending_item: str | None = None
        """The id the user item speaking now will have (VAD started, not stopped)."""
        self.speech_end: float | None = None
        self.worst_gap_s = 0.0
        self.transcribing: Literal["realtime", "transcription"] = "realtime"
        """`transcription`: each committed turn is transcribed, and no response is made."""
        self.language: str | None = None
        self.transcriptions: set[Transcription] = set()

    # --- what the client sees of the session ------------------------------------------

    def describe(self) -> dict[str, Any]:
        heard, said = (described(f) for f in (self.input_format, self.output_format))
        vad = None if self.vad_config is None else self.vad_config.model_dump(exclude_none=True)
        if self.transcribing == "transcription":
            hearing = {"model": self.served.name, "language": self.language}
            return {"type": "transcription", "object": "realtime.transcription_session",
                    "id": self.id, "audio": {"input": {"format": heard, "turn_detection": vad,
                                                       "transcription": hearing}}}  # fmt: skip
        return {
            "type": "realtime", "object": "realtime.session", "id": self.id,
            "model": self.served.name, "output_modalities": self.modalities,
            "instructions": self.instructions,
            "tools": [t.model_dump(exclude_none=True) for t in self.tools],
            "tool_choice": shown_choice(self.tool_choice),
            "max_output_tokens": self.max_tokens or self.served.default_max_tokens or "inf",
            "truncation": self.truncation,
            "audio": {"input": {"format": heard, "turn_detection": vad, "transcription": None},
                      "output": {"format": said, "voice": self.voice, "speed": self.speed}},
        }  # fmt: skip

    def _new_vad(self) -> VoiceActivity | None:
        c = self.vad_config
        if c is None:
            return None
        silence = DEFAULT_SILENCE_MS if c.silence_duration_ms is None else c.silence_duration_ms
        padding = DEFAULT_PADDING_MS if c.prefix_padding_ms is None else c.prefix_padding_ms
        return VoiceActivity(0.5 if c.threshold is None else c.threshold, silence, padding)

    # --- client events --------------------------------------------------------------------

    def handle(self, ev: ClientEvent) -> None:
        """Apply one client event; EventError: the `error` event to send."""
        if isinstance(ev, SessionUpdate):
            self._update(ev)
        elif isinstance(ev, BufferAppend):
            self._append(decode_audio(ev.audio, "audio", self.decode))
        elif isinstance(ev, BufferCommit):
            self._commit(None)
        elif isinstance(ev, BufferClear):
            self.buffer.clear()
            if self.vad is not None:
                self.vad.reset()
            self.emit(event("input_audio_buffer.cleared"))
        elif isinstance(ev, ItemCreate):
            self._create_item(ev)
        elif isinstance(ev, ItemRetrieve):
            self.conversation.retrieve(ev.item_id)
        elif isinstance(ev, ItemDelete):
            self._delete(ev.item_id)
        elif isinstance(ev, ItemTruncate):
            item = self.conversation.truncatable(ev.item_id, ev.content_index, ev.audio_end_ms)
            if self.active is not None and self.active.item is item:  # the user stopped it
                self.active.cancel("client_cancelled")
            self.conversation.truncate(item, ev.content_index, ev.audio_end_ms)
        elif isinstance(ev, ResponseCreate):
            self._respond(ev)
        elif isinstance(ev, ResponseCancel):
            if self.active is None or ev.response_id not in (None, self.active.id):
                raise EventError("no response in progress to cancel",
                                 code="response_cancel_not_active")  # fmt: skip
            self.active.cancel("client_cancelled")

    def _modalities(self, given: Sequence[str] | None) -> list[str]:
        outs = self.served.outputs
        if given is None:
            return self.modalities
        mods = sorted(set(given), key=["text", "audio"].index)
        if "audio" in mods and outs.audio_stage is None:
            raise EventError(f"the model {self.served.name!r} has no audio output",
                             param="output_modalities")  # fmt: skip
        if outs.text_stage is None and "text" in mods:
            raise EventError(f"the model {self.served.name!r} has no text output",
                             param="output_modalities")  # fmt: skip
        return mods

    def _tools(
        self, tools: list[RealtimeTool] | None, choice: RealtimeToolChoice | None, where: str
    ) -> tuple[list[RealtimeTool], RealtimeToolChoice]:
        """The tools and choice `where` ("session", "response") asks for, checked."""
        tools = self.tools if tools is None else tools
        choice = self.tool_choice if choice is None else choice
        checked_tools(tools, choice, where, self.served.name, self.served.outputs.tools)
        return tools, choice

    def _update(self, ev: SessionUpdate) -> None:
        s = ev.session
        modalities = self._modalities(s.output_modalities)
        tools = self._tools(s.tools, s.tool_choice, "session")  # checked before any change
        if s.type == "transcription" and (why := check_transcribes(self.served)) is not None:
            raise EventError(why, param="session.type")
        if s.type not in (None, self.transcribing) and self.active is not None:
            raise EventError(f"response {self.active.id} is in progress: cancel it first",
                             code="conversation_already_has_active_response")  # fmt: skip
        self._apply_audio(s.audio)
        self.transcribing = s.type or self.transcribing
        if s.audio is not None and s.audio.input is not None and s.audio.input.transcription:
            self.language = s.audio.input.transcription.language
        self.modalities = modalities
        self.tools, self.tool_choice = tools
        if s.instructions is not None:
            self.instructions = s.instructions
        if s.max_output_tokens is not None:
            self.max_tokens = None if s.max_output_tokens == "inf" else s.max_output_tokens
        if s.truncation is not None:
            self.truncation = s.truncation
        self.emit(event("session.updated", session=self.describe()))

    def _apply_audio(self, audio: AudioConfig | None) -> None:
        if audio is None:
            return
        heard = audio.input.format.type if audio.input and audio.input.format else None
        said = audio.output.format.type if audio.output and audio.output.format else None
        for side, kind in (("input", heard), ("output", said)):
            if kind is not None and (why := uncodable(kind)) is not None:
                raise EventError(why, param=f"session.audio.{side}.format")
        if heard is not None and heard != self.input_format:
            self.input_format, self.decode = heard, InputDecoder(heard)
        if said is not None:
            self.output_format = said
        if audio.input is not None and "turn_detection" in audio.input.model_fields_set:
            self.vad_config = audio.input.turn_detection
            self.vad = self._new_vad()
        if audio.output is not None:
            voice = audio.output.voice
            if voice is not None:
                self.voice = voice if isinstance(voice, str) else voice.id
            if audio.output.speed is not None:
                self.speed = audio.output.speed

    def _append(self, pcm: bytes) -> None:
        if len(self.buffer) + len(pcm) > self.max_buffer_bytes:
            raise EventError(
                f"the input audio buffer would exceed {self.max_buffer_bytes // BYTES_PER_MS}"
                " ms (OMNI_REALTIME_MAX_BUFFER_S): commit or clear it",
                code="input_audio_buffer_full",
            )
        self.buffer += pcm
        if self.vad is None:
            return
        for turn in self.vad.feed(pcm):
            if turn.kind == "started":
                self._speech_started(turn.ms)
            else:
                self._speech_stopped(turn.ms)

    def _speech_started(self, at_ms: int) -> None:
        # keep the padding before the speech, drop the silence before that
        padding = self.vad.padding_ms if self.vad is not None else 0
        heard_ms = self.vad.heard_ms if self.vad is not None else 0
        keep = (heard_ms - at_ms + padding) * BYTES_PER_MS
        if len(self.buffer) > keep:
            del self.buffer[: len(self.buffer) - keep]
        self.pending_item = new_id("item")
        self.emit(event("input_audio_buffer.speech_started", item_id=self.pending_item,
                        audio_start_ms=max(0, at_ms - padding)))  # fmt: skip
        interrupt = self.vad_config is None or self.vad_config.interrupt_response is not False
        if interrupt and self.active is not None:
            self.gateway.metrics.inc("omni_realtime_barge_ins_total")
            self.active.cancel("turn_detected")

    def _speech_stopped(self, at_ms: int) -> None:
        item_id, self.pending_item = self.pending_item or new_id("item"), None
        self.emit(event("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=at_ms))
        self._commit(item_id)
        if self.transcribing == "transcription":
            return
        if self.vad_config is not None and self.vad_config.create_response is not False:
            self._respond(None)

    def _commit(self, item_id: str | None) -> None:
        if len(self.buffer) < MIN_COMMIT_MS * BYTES_PER_MS:
            raise EventError(f"the input audio buffer holds less than {MIN_COMMIT_MS} ms",
                             code="input_audio_buffer_commit_empty")  # fmt: skip
        item = Item(item_id or new_id("item"), "user", kind="audio", audio=bytes(self.buffer))
        self.buffer.clear()
        if self.vad is not None:
            self.vad.reset()
        self.speech_end = asyncio.get_running_loop().time()
        self.emit(event("input_audio_buffer.committed", item_id=item.id,
                        previous_item_id=self.conversation.last_id))  # fmt: skip
        self.conversation.add(item)
        if self.transcribing == "transcription":
            wav = wav_bytes(item.audio or b"", SAMPLE_RATE)
            turn = Transcription(self.gateway, self.served, self.emit, item, wav, self.language,
                                 self._transcribed)  # fmt: skip
            self.transcriptions.add(turn)
            turn.start()

    def _transcribed(self, turn: Transcription) -> None:
        self.transcriptions.discard(turn)
        if self.active is None and not self.transcriptions:
            self.on_idle()

    def _create_item(self, ev: ItemCreate) -> None:
        item = item_of(ev.item, self.conversation.items, self.input_format, "item")
        self.conversation.add(item, ev.previous_item_id)

    def _delete(self, item_id: str) -> None:
        if self.active is not None and self.active.item.id == item_id:
            raise EventError(f"item {item_id!r} is being answered: cancel its response first",
                             param="item_id")  # fmt: skip
        self.conversation.delete(item_id)

    # --- responses ------------------------------------------------------------------------

    def _respond(self, ev: ResponseCreate | None) -> None:
        if self.transcribing == "transcription":
            raise EventError("a transcription session makes no responses", param="type")
        if self.active is not None:
            raise EventError(f"response {self.active.id} is in progress: cancel it first",
                             code="conversation_already_has_active_response")  # fmt: skip
        fields = ev.response if ev is not None else None
        modalities = self._modalities(fields.output_modalities if fields else None)
        instructions = fields.instructions if fields and fields.instructions else None
        given = fields.input if fields is not None else None
        context = self.conversation
        if given is not None:
            context = self.conversation.context(given, self.input_format)
        prompt, heard = self._prompt(instructions or self.instructions, context)
        params: dict[str, Any] = {"voice": self.voice, "speed": self.speed,
                                  "max_tokens": self.max_tokens,
                                  "truncation": self.truncation}  # fmt: skip
        if fields is not None and fields.max_output_tokens not in (None, "inf"):
            params["max_tokens"] = fields.max_output_tokens
        tools, choice = self._tools(fields.tools if fields else None,
                                    fields.tool_choice if fields else None, "response")  # fmt: skip
        named = choice.name if isinstance(choice, NamedTool) else None
        params |= tool_params(tools, choice if isinstance(choice, str) else None, named)
        if fields is not None and fields.audio is not None and fields.audio.output is not None:
            voice = fields.audio.output.voice
            params["voice"] = voice if isinstance(voice, str) or voice is None else voice.id
        response = Response(
            self.gateway, self.served, self.emit, prompt,
            {k: v for k, v in params.items() if v is not None}, modalities, heard,
            self.speech_end, Playback(), self._response_done, self.timeout_s,
            output_format=self.output_format, apart=bool(fields and fields.conversation == "none"),
        )  # fmt: skip
        self.speech_end = None
        self.active = response
        self.conversation.join([] if response.apart else [response.item])  # out of band: none
        self.gateway.metrics.inc("omni_realtime_turns_total")
        response.start()

    def _response_done(self, response: Response, status: Status) -> None:
        self.conversation.join([] if response.apart else response.calls)
        if self.active is response:
            self.active = None
            self.on_idle()
        if status == "cancelled":
            self.gateway.metrics.inc("omni_realtime_responses_cancelled_total")
        self.worst_gap_s = max(self.worst_gap_s, response.playback.worst_gap_s)

    def _prompt(self, instructions: str, context: Conversation) -> tuple[Any, Item | None]:
        """What stage 0 takes for the next response, and the spoken item it will hear."""
        mode, items, messages = self.served.outputs.input, context.items, context.messages
        user = next((i for i in reversed(items) if i.role == "user"), None)
        if user is None:
            raise EventError("the conversation has no user item to answer")
        if mode == "audio":
            spoken = next((i for i in reversed(items) if i.audio), None)
            if spoken is None and self.served.outputs.text_turns:
                # a typed turn, a tool's output: nothing new to hear (`spoken_turn.py`)
                return {"wav": None, "messages": messages(instructions)}, None
            if spoken is None:
                raise EventError(f"the model {self.served.name!r} takes speech: append and "
                                 "commit audio (or create an input_audio item)")  # fmt: skip
            # what came after the unheard turn (calls, a tool's output) is read after it
            prompt: dict[str, Any] = {"wav": wav_bytes(spoken.audio or b"", SAMPLE_RATE)}
            if history := messages(instructions, before=spoken):
                prompt["messages"] = history
            if after := messages("", after=spoken):
                prompt["after"] = after
            return prompt, spoken
        unheard = [i for i in items if i.kind == "audio" and not i.text]
        if unheard and unheard[-1] is user:
            raise EventError(f"the model {self.served.name!r} has no speech-to-text stage: "
                             "send text items")  # fmt: skip
        if mode == "text":
            return user.text, None
        return {"messages": messages(instructions)}, None

    def close(self) -> None:
        """The socket went away: abort what is in flight."""
        if self.active is not None:
            self.active.cancel("client_cancelled")
        for turn in list(self.transcriptions):
            turn.cancel()
        self.gateway.metrics.observe("omni_realtime_session_worst_gap_seconds", self.worst_gap_s)
