"""The OpenAI Realtime API's events, as `/v1/realtime` takes and sends them (GA names).

Client events are validated here, at the boundary, by pydantic: a known `type` with a
body that does not fit, or an unknown `type`, becomes one `error` event (`EventError`)
and the session goes on. Fields this server has no use for (noise reduction,
transcription models, ...) are ignored, as the chat endpoint ignores its own; what it
uses is checked and bounded. Server events are plain dicts with a fresh `event_id`.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
)

from omni_runtime.http.errors import field_path
from omni_runtime.http.tools import FunctionDef, ToolName, choice_problem

MAX_TEXT_CHARS = 32_768
MAX_PARTS = 16
MAX_ID_CHARS = 128
SAMPLE_RATE = 24_000
"""OpenAI's `audio/pcm`: 16-bit little-endian mono at 24 kHz, both ways."""

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Modalities = Annotated[list[Literal["text", "audio"]], Field(min_length=1, max_length=2)]


class EventError(ValueError):
    """A client event this server cannot take: sent back as one `error` event."""

    def __init__(
        self,
        message: str,
        code: str = "invalid_value",
        param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        """`kind`: OpenAI's error type; `server_error` for what is not the client's doing."""
        super().__init__(message)
        self.code = code
        self.param = param
        self.kind = kind


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PcmFormat(_Body):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = 24000


class G711Format(_Body):
    """Telephony's 8 kHz G.711: `audio/pcmu` (μ-law), `audio/pcma` (A-law)."""

    type: Literal["audio/pcmu", "audio/pcma"]


AudioFormat = Annotated[PcmFormat | G711Format, Field(discriminator="type")]


class ServerVad(_Body):
    type: Literal["server_vad"]
    threshold: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    prefix_padding_ms: Annotated[int, Field(ge=0, le=5_000)] | None = None
    silence_duration_ms: Annotated[int, Field(ge=0, le=10_000)] | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None


class InputTranscription(_Body):
    """How a transcription session hears: `language` reaches the stage (`model` is the
    session's pipeline, named when connecting)."""

    language: Annotated[str, Field(min_length=1, max_length=32)] | None = None


class AudioInput(_Body):
    format: AudioFormat | None = None
    turn_detection: ServerVad | None = None
    """Given as null: turn detection off (the client commits and asks for responses)."""
    transcription: InputTranscription | None = None


class VoiceRef(_Body):
    id: Id


class AudioOutput(_Body):
    format: AudioFormat | None = None
    voice: Id | VoiceRef | None = None
    speed: Annotated[float, Field(ge=0.25, le=4.0, allow_inf_nan=False)] | None = None


class AudioConfig(_Body):
    input: AudioInput | None = None
    output: AudioOutput | None = None


class RealtimeTool(FunctionDef):
    """A function as a Realtime session takes it: flat (`name`, `parameters`, ... beside
    `type`), where the chat endpoint nests it under `function`."""

    type: Literal["function"] = "function"


class NamedTool(_Body):
    type: Literal["function"]
    name: ToolName


RealtimeToolChoice = Literal["auto", "none", "required"] | NamedTool
Tools = Annotated[list[RealtimeTool], Field(max_length=128)]


class SessionFields(_Body):
    type: Literal["realtime", "transcription"] | None = None
    instructions: Text | None = None
    output_modalities: Modalities | None = None
    audio: AudioConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=4096)] | Literal["inf"] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    tools: Tools | None = None
    tool_choice: RealtimeToolChoice | None = None


class ContentPart(_Body):
    type: Literal["input_text", "input_audio", "text", "output_text", "output_audio"]
    text: Text | None = None
    transcript: Text | None = None
    audio: str | None = None
    """Base64 audio in the session's input format (an `input_audio` part)."""


class MessageItem(_Body):
    type: Literal["message"] = "message"
    id: Id | None = None
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[ContentPart], Field(min_length=1, max_length=MAX_PARTS)]


class CallItem(_Body):
    """A call the assistant made (a client may put one in the conversation)."""

    type: Literal["function_call"]
    id: Id | None = None
    call_id: Id
    name: ToolName
    arguments: Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class CallOutputItem(_Body):
    """What a call returned: the client's answer to a `function_call` item."""

    type: Literal["function_call_output"]
    id: Id | None = None
    call_id: Id
    output: Text


class ItemReference(_Body):
    """An item of the session's conversation, by its id (in a response's `input`)."""

    type: Literal["item_reference"]
    id: Id


def _item_class(item: Any) -> str | None:
    """An item's model, by its `type` (named so in errors' paths, which drop it)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return _ITEM_CLASSES.get(kind) if isinstance(kind, str) else None


_ITEM_CLASSES = {"message": "MessageItem", "function_call": "CallItem",
                 "function_call_output": "CallOutputItem",
                 "item_reference": "ItemReference"}  # fmt: skip
ClientItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[CallItem, Tag("CallItem")]
    | Annotated[CallOutputItem, Tag("CallOutputItem")],
    Discriminator(
        _item_class,
        custom_error_type="invalid_item",
        custom_error_message="an item's type must be 'message', 'function_call' or "
        "'function_call_output'",
    ),
]
ContextItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[CallItem, Tag("CallItem")]
    | Annotated[CallOutputItem, Tag("CallOutputItem")]
    | Annotated[ItemReference, Tag("ItemReference")],
    Discriminator(
        _item_class,
        custom_error_type="invalid_item",
        custom_error_message="an item's type must be 'message', 'function_call', "
        "'function_call_output' or 'item_reference'",
    ),
]
"""An item of a response's own context: one given whole, or one of the conversation's."""


class ResponseFields(_Body):
    instructions: Text | None = None
    tools: Tools | None = None
    tool_choice: RealtimeToolChoice | None = None
    output_modalities: Modalities | None = None
    audio: AudioConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=4096)] | Literal["inf"] | None = None
    conversation: Literal["auto", "none"] | None = None
    """`none`: out of band, the answer joins no conversation (`Response.apart`)."""
    input: Annotated[list[ContextItem], Field(max_length=256)] | None = None
    """The response's own context instead of the conversation (`[]`: none)."""


class _Event(_Body):
    event_id: Id | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionFields


class BufferAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class BufferCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class BufferClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    item: ClientItem
    previous_item_id: Id | None = None


class ItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: Id


class ItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: Id


class ItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: Id
    content_index: Annotated[int, Field(ge=0, le=1)]
    audio_end_ms: Annotated[int, Field(ge=0)]


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseFields | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: Id | None = None


ClientEvent = (
    SessionUpdate
    | BufferAppend
    | BufferCommit
    | BufferClear
    | ItemCreate
    | ItemRetrieve
    | ItemDelete
    | ItemTruncate
    | ResponseCreate
    | ResponseCancel
)
_CLIENT: TypeAdapter[ClientEvent] = TypeAdapter(Annotated[ClientEvent, Field(discriminator="type")])
KNOWN_TYPES = frozenset(
    {
        "session.update",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "input_audio_buffer.clear",
        "conversation.item.create",
        "conversation.item.retrieve",
        "conversation.item.delete",
        "conversation.item.truncate",
        "response.create",
        "response.cancel",
    }
)


def checked_tools(
    tools: list[RealtimeTool], choice: RealtimeToolChoice, where: str, model: str, calls: bool
) -> None:
    """EventError for tools `where` ("session", "response") cannot call: the model's
    pipeline `calls` none, or the choice names none of them or needs them."""
    if tools and choice != "none" and not calls:
        raise EventError(f"the model {model!r} calls no tools (its pipeline's outputs.tools "
                         "is false)", code="unsupported_parameter", param=f"{where}.tools")  # fmt: skip
    named = choice.name if isinstance(choice, NamedTool) else None
    plain = choice if isinstance(choice, str) else None
    if (why := choice_problem({t.name for t in tools}, plain, named)) is not None:
        raise EventError(why, param=f"{where}.tool_choice")


def shown_choice(choice: RealtimeToolChoice) -> Any:
    return choice if isinstance(choice, str) else choice.model_dump()


def parse_client_event(raw: str | bytes) -> ClientEvent:
    """One WebSocket message as a client event; EventError says what is wrong with it."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise EventError("the event is not JSON", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise EventError("the event is not a JSON object", code="invalid_json")
    kind = doc.get("type")
    if not isinstance(kind, str) or kind not in KNOWN_TYPES:
        shown = kind[:64] if isinstance(kind, str) else kind
        raise EventError(
            f"unsupported event type {shown!r}", code="unknown_event_type", param="type"
        )
    try:
        return _CLIENT.validate_python(doc)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(field_path(first["loc"][1:]))  # no union members' tags
        raise EventError(f"{kind}: {where}: {first['msg']}", param=where or None) from None


def decode_audio(data: str, param: str, decode: Callable[[bytes], bytes]) -> bytes:
    """Base64 audio in the session's input format as 24 kHz PCM16 (`decode`: its
    `InputDecoder`); EventError for what is not base64 or not whole samples."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise EventError("audio is not base64", param=param) from None
    try:
        return decode(raw)
    except ValueError as e:
        raise EventError(str(e), param=param) from None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """A server event: its `type`, a fresh `event_id`, and the fields given."""
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(err: EventError, event_id: str | None = None) -> dict[str, Any]:
    body = {"type": err.kind, "code": err.code, "message": str(err)}
    body.update({"param": err.param} if err.param else {})
    body.update({"event_id": event_id} if event_id else {})
    return event("error", error=body)
