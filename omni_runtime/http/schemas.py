"""The OpenAI-shaped request and response bodies, validated and bounded by pydantic.

Requests ignore fields that change nothing in the answer (`user`, `metadata`, `store`, …)
so that stock OpenAI clients work, and refuse those that would (`tools`, `logprobs`); what
it does use is checked and size-bounded, and the sampling, voice and JSON-shaping fields
become the request's parameters (`params()`), which every stage receives and takes the
keys it knows of.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from omni_runtime.core.types import MAX_PARAM_STR_CHARS, FinishReason, param_json
from omni_runtime.http.tools import (
    CallDelta,
    CallMade,
    CallOut,
    FunctionTool,
    ToolChoice,
    calls_written,
    chat_tool_params,
    result_written,
    unknown_choice,
)

ShortStr = Annotated[str, Field(min_length=1, max_length=256)]
MAX_MESSAGES = 1024
MAX_TEXT_CHARS = 1_000_000
MAX_PARTS = 64
MAX_TOKENS = 1 << 20
"""A bound on `max_tokens` for the front door; each thinker enforces its own, lower one."""
Modality = Literal["text", "audio"]
StopStr = Annotated[str, Field(min_length=1, max_length=64)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
"""OpenAI's range for `frequency_penalty` and `presence_penalty`."""
Speed = Annotated[float, Field(ge=0.25, le=4.0, allow_inf_nan=False)]


def _text_only() -> list[Modality]:
    return ["text"]  # OpenAI's default


class RequestModel(BaseModel):
    """A request body: fields that change nothing in the answer are ignored."""

    model_config = ConfigDict(extra="ignore")


class TextPart(RequestModel):
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class InputAudio(RequestModel):
    data: Annotated[str, Field(min_length=1)]
    """Base64 of a WAV or MP3 file (the body's size bounds it: `OMNI_MAX_BODY_BYTES`); it is
    read by its content (FLAC and Ogg are too), not by `format`."""
    format: Literal["wav", "mp3"]


class AudioPart(RequestModel):
    """Speech in a user message, for a pipeline that hears (`outputs.input: audio`)."""

    type: Literal["input_audio"]
    input_audio: InputAudio


def _part_class(part: Any) -> str | None:
    """A content part's model, by its `type`: named so in errors' paths, which drop it."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return (
        {"text": "TextPart", "input_audio": "AudioPart"}.get(kind)
        if isinstance(kind, str)
        else None
    )


Part = Annotated[
    Annotated[TextPart, Tag("TextPart")] | Annotated[AudioPart, Tag("AudioPart")],
    Discriminator(
        _part_class,
        custom_error_type="invalid_part",
        custom_error_message="a content part's type must be 'text' or 'input_audio'",
    ),
]


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: (
        Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
        | Annotated[list[Part], Field(max_length=MAX_PARTS)]
        | None
    ) = None
    tool_calls: Annotated[list[CallMade], Field(max_length=128)] | None = None
    """An assistant message's calls (the history of a chat with tools)."""
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None
    """A tool message's call: the result it gives is that call's."""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def audio(self) -> list[InputAudio]:
        if isinstance(self.content, list):
            return [part.input_audio for part in self.content if isinstance(part, AudioPart)]
        return []


class VoiceId(RequestModel):
    id: ShortStr


def voice_name(voice: str | VoiceId | None) -> str | None:
    return voice.id if isinstance(voice, VoiceId) else voice


class AudioParams(RequestModel):
    format: Literal["wav", "mp3", "flac", "opus", "pcm16"] = "wav"
    """Non-streamed: `message.audio.data` as a file of that format or raw pcm16. Streamed:
    always pcm16."""
    voice: ShortStr | VoiceId | None = None
    """`params["voice"]`: the voice stages take it (an unknown one fails the request there)."""


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str, Field(max_length=4096)] | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = Field(default_factory=dict)
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _fits_a_param(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if len(param_json(schema)) > MAX_PARAM_STR_CHARS:
            raise ValueError(f"the schema must be at most {MAX_PARAM_STR_CHARS} characters of JSON")
        return schema


class ResponseFormat(RequestModel):
    """Text, or JSON shaped by the text stage (`outputs.structured` pipelines only): any
    JSON object, or one that `json_schema.schema` describes."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self

    def params(self) -> dict[str, str]:
        """The stages' `response_format` and `json_schema` (compact JSON, a param's size)."""
        if self.type == "text":
            return {}
        given: dict[str, str] = {"response_format": self.type}
        if self.json_schema is not None:
            given["json_schema"] = param_json(self.json_schema.schema_)
        return given


class ChatCompletionRequest(RequestModel):
    model: ShortStr
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: Annotated[list[Modality], Field(min_length=1, max_length=2)] = Field(
        default_factory=_text_only
    )
    audio: AudioParams | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    """OpenAI's newer name for `max_tokens`; it wins when both are given."""
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=4)] | None = None
    seed: Annotated[int, Field(ge=0, lt=1 << 32)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    """One choice per request: the pipeline makes one answer."""
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    """Called by the text stage (`outputs.tools` pipelines only): `core/tool_calls.py`."""
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=1024)] | None = None
    web_search_options: Annotated[dict[str, Any], Field(max_length=16)] | None = None
    """Parsed to be refused (`refused()`): a pipeline searches no web, reports no log
    probabilities and biases no token ids (a front door knows no model's vocabulary);
    accepting them silently would be a wrong answer."""

    def refused(self) -> tuple[str, str] | None:
        """(param, why) of the first field set that no pipeline can honour."""
        if self.logprobs or self.top_logprobs:
            return ("logprobs" if self.logprobs else "top_logprobs"), "logprobs are not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.web_search_options is not None:  # given at all, even empty, OpenAI searches
            return "web_search_options", "web search is not supported"
        return None

    @model_validator(mode="after")
    def _has_user_message(self) -> ChatCompletionRequest:
        if not any(m.role == "user" for m in self.messages):
            raise ValueError("messages must contain a user message (its text is the prompt)")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _a_choice_among_the_tools(
        cls, choice: ToolChoice | None, info: ValidationInfo
    ) -> ToolChoice | None:
        if (why := unknown_choice(info.data.get("tools"), choice)) is not None:
            raise ValueError(why)
        return choice

    @property
    def calls_tools(self) -> bool:
        return bool(self.tool_params())

    def tool_params(self) -> dict[str, Any]:
        return chat_tool_params(self.tools, self.tool_choice, self.parallel_tool_calls)

    def params(self) -> dict[str, Any]:
        """The request's parameters for the stages: only what the client set."""
        given: dict[str, Any] = {
            "max_tokens": self.max_completion_tokens or self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "seed": self.seed,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "voice": voice_name(self.audio.voice) if self.audio else None,
        }
        shaped = self.response_format.params() if self.response_format else {}
        return {k: v for k, v in given.items() if v is not None} | shaped | self.tool_params()

    def conversation(self, before: int | None = None) -> dict[str, Any]:
        """The messages (those `before` an index, if given) as a chat pipeline's stage 0
        takes them: roles `system`, `user`, `assistant` (a `developer` message is a system
        one), content as plain text; an assistant's calls and the tools' results are
        written as the text stage reads them (`core/tool_calls.py`)."""
        messages = []
        names = {c.id: c.function.name for m in self.messages for c in m.tool_calls or ()}
        for m in self.messages[:before]:
            role, text = ("system" if m.role == "developer" else m.role), m.text()
            if m.role == "tool":
                role, text = "user", result_written(m.tool_call_id, text, names)
            elif m.tool_calls:
                text = "\n".join(t for t in (text, calls_written(m.tool_calls)) if t)
            messages.append({"role": role, "content": text})
        return {"messages": messages}

    @property
    def prompt(self) -> str:
        """The last user message's text: the pipeline takes one prompt, not a conversation."""
        return next(m.text() for m in reversed(self.messages) if m.role == "user")

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities


# --- responses -------------------------------------------------------------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omni-runtime"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AudioOut(BaseModel):
    id: str
    data: str
    """Base64 of a file (format wav, mp3, flac, opus) or of raw pcm16 (format pcm16)."""
    expires_at: int
    transcript: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    audio: AudioOut | None = None
    tool_calls: list[CallOut] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason = "stop"
    logprobs: None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Of the prompt's tokens, those the engine's prompt cache held (llama.cpp, vLLM)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    """When the engine counted the tokens (not the front door's estimate)."""


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class AudioDelta(BaseModel):
    """Streamed audio, as OpenAI streams it: `id` on every delta, then `data` (base64 pcm16)
    or `transcript` (the text that audio speaks), and `expires_at` on the last one."""

    id: str
    data: str | None = None
    transcript: str | None = None
    expires_at: int | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    audio: AudioDelta | None = None
    tool_calls: list[CallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
