"""A Responses API request (`POST /v1/responses`), read as the chat completion it amounts to.

OpenAI's Responses API says the same things as its chat endpoint in other words:
`instructions` is a system message; `input` is the messages (a string: one user turn;
items: `message`s, the `function_call`s an answer made and the `function_call_output`s
the client ran); `tools` are functions, flat; `text.format` is the `response_format`;
`max_output_tokens` the `max_completion_tokens`; `previous_response_id` or
`conversation`, the items a kept response or conversation holds, before `input`
(`response_store`). `as_chat` writes it as that chat, so it is checked and run as one (the
same prompt, parameters and 400s). Background responses are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, model_validator

from omni_runtime.errors import in_words
from omni_runtime.http.errors import ApiError
from omni_runtime.http.realtime_events import NamedTool, RealtimeTool
from omni_runtime.http.schemas import (
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_TEXT_CHARS,
    MAX_TOKENS,
    ChatCompletionRequest,
    RequestModel,
    ShortStr,
)
from omni_runtime.http.tools import MAX_ARGUMENTS_CHARS, ToolName

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
CallId = Annotated[str, Field(min_length=1, max_length=256)]
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
]
"""OpenAI's metadata: up to 16 pairs, keys up to 64 characters, values up to 512."""


class ContentPart(RequestModel):
    """Text: what a user said (`input_text`) or an earlier answer (`output_text`)."""

    type: Literal["input_text", "output_text"]
    text: Text


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)]

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: CallId
    name: ToolName
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENTS_CHARS)]


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: CallId
    output: Text


def _item_type(item: Any) -> Any:
    """An item's `type`; a message may leave it out (`{"role", "content"}`)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class TextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or JSON a schema describes (its `name`,
    `schema`, `strict` beside `type`, where the chat endpoint nests them)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        described = {"name": self.name, "description": self.description,
                     "schema": self.schema_ or {}, "strict": self.strict}  # fmt: skip
        return {
            "type": self.type,
            "json_schema": {k: v for k, v in described.items() if v is not None},
        }


class TextConfig(RequestModel):
    format: TextFormat | None = None


ObjectId = Annotated[str, Field(min_length=1, max_length=256)]


class ConversationRef(RequestModel):
    id: ObjectId


class ResponsesRequest(RequestModel):
    model: ShortStr
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    tools: Annotated[list[RealtimeTool], Field(max_length=128)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    """`auto`: a conversation longer than the thinker's context loses its oldest turns
    (the thinker's `truncation` parameter, as a Realtime session's); else it is a 400."""
    stream: bool = False
    metadata: Metadata = Field(default_factory=dict)
    store: bool = True
    """Keep the response for `previous_response_id` (as OpenAI, by default)."""
    previous_response_id: ObjectId | None = None
    conversation: ObjectId | ConversationRef | None = None
    """The conversation the response reads before `input`, and to which its input and
    output are added when it ends: its id, or `{"id": ...}`."""
    background: bool | None = None
    """Answer at once and run on without the client (`background.py`); kept, so not with
    `store: false`."""
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """Refused above 0, as the chat's: no pipeline reports log probabilities."""

    @model_validator(mode="after")
    def _says_something(self) -> ResponsesRequest:
        if isinstance(self.input, str) and not self.input.strip():
            raise ValueError("input is empty")
        return self

    def refused(self) -> tuple[str, str, str] | None:
        """(param, why, code) of the first field set that this server cannot honour."""
        if self.conversation is not None and self.previous_response_id is not None:
            return (
                "conversation",
                (
                    "Mutually exclusive parameters: Ensure you are only providing one of: "
                    "'previous_response_id' or 'conversation'."
                ),
                "invalid_value",
            )
        if self.background and not self.store:
            why = "a background response is kept: ask without store: false"
            return "background", why, "invalid_value"
        unsupported = "unsupported_parameter"
        if self.top_logprobs:
            return "top_logprobs", "logprobs are not supported", unsupported
        return None

    def conversation_id(self) -> str | None:
        conv = self.conversation
        return conv.id if isinstance(conv, ConversationRef) else conv

    def params(self, chat: ChatCompletionRequest) -> dict[str, Any]:
        """The stages' parameters: the chat's, and the thinker's `truncation`."""
        return chat.params() | ({"truncation": self.truncation} if self.truncation else {})

    def own_items(self) -> list[InputItem]:
        """`input` as items (a string is one user turn)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def as_chat(self, history: Sequence[InputItem] = ()) -> ChatCompletionRequest:
        """The chat completion this request amounts to, after the `history` of the response
        it follows; a 400 naming `input` if the items do not make one (no user turn among
        them, a value the chat refuses)."""
        items = [*history, *self.own_items()]
        if len(items) > MAX_MESSAGES:
            raise ApiError(
                400,
                f"the conversation holds {len(items)} items with the responses before this "
                f"one, more than {MAX_MESSAGES}: begin another",
                param="conversation" if self.conversation else "previous_response_id",
                code="invalid_value",
            )
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                if not (messages and messages[-1]["role"] == "assistant"):
                    messages.append({"role": "assistant", "content": None, "tool_calls": []})
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
        chat: dict[str, Any] = {
            "model": self.model, "messages": messages, "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
            "tools": [{"type": "function", "function": t.model_dump(exclude={"type"})}
                      for t in self.tools] if self.tools else None,
            "tool_choice": {"type": "function", "function": {"name": self.tool_choice.name}}
            if isinstance(self.tool_choice, NamedTool) else self.tool_choice,
            "response_format": self.text.format.response_format()
            if self.text and self.text.format else None,
        }  # fmt: skip
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:
            raise ApiError(400, in_words(e), param="input", code="invalid_value") from None
