"""A chat request as llama.cpp's server takes it: the conversation, the sampling, and the
shape of the answer (JSON by `response_format`, or text-or-calls by `tools`: the shape of
`core/tool_calls.py`, held by llama.cpp's grammar), from a request's prompt and parameters.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omni_runtime.core.tool_calls import (
    TOOL_NAME,
    AnswerReader,
    answer_schema,
    calls_output,
    tools_instructions,
)
from omni_runtime.core.types import MAX_PARAM_STR_CHARS
from omni_runtime.errors import in_words
from omni_runtime.stage_api import Final, RequestRefused

MAX_PROMPT_CHARS = 32_000
MAX_MESSAGES = 256
MAX_TOOLS = 128


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class ChatPrompt(BaseModel):
    """Stage 0's input as a conversation (`{"messages": [...]}`), e.g. from the HTTP API."""

    model_config = ConfigDict(extra="ignore")

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class SamplingParams(BaseModel):
    """The request parameters the thinker honours; other stages' keys (`voice`) pass by."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: Annotated[int, Field(ge=1, le=4096)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stop: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=4)
    ] = Field(default_factory=list)
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    """`auto`: a conversation longer than the context loses its oldest turns (a Realtime
    session's default) instead of failing, as it does otherwise (chat completions)."""
    response_format: Literal["text", "json_object", "json_schema"] | None = None
    """JSON only: llama.cpp constrains each token to a grammar (any object, or `json_schema`)."""
    json_schema: Annotated[str, Field(max_length=MAX_PARAM_STR_CHARS)] | None = None
    """The schema of a `json_schema` answer, as JSON text (a request parameter is flat)."""
    tools: (
        Annotated[
            list[Annotated[str, Field(max_length=MAX_PARAM_STR_CHARS)]],
            Field(min_length=1, max_length=MAX_TOOLS),
        ]
        | None
    ) = None
    """Functions the answer may call, each `{"name", "description", "parameters"}` as JSON."""
    tool_choice: Literal["auto", "required"] | None = None
    """`required`: the answer is calls, never text (default `auto`: either)."""
    tool_name: Annotated[str, Field(pattern=TOOL_NAME)] | None = None
    """The one tool the answer calls (OpenAI's named `tool_choice`)."""
    parallel_tool_calls: bool | None = None
    """False: one call at most (default: any number)."""

    @model_validator(mode="after")
    def _schema_with_its_format(self) -> SamplingParams:
        if (self.response_format == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                "json_schema is given with response_format 'json_schema', and only then"
            )
        if self.tools is None and (self.tool_choice or self.tool_name):
            raise ValueError("tool_choice and tool_name need tools")
        if self.tools is not None and self.response_format not in (None, "text"):
            raise ValueError("an answer shaped by response_format cannot call tools")
        return self

    def tool_list(self) -> list[dict[str, Any]]:
        """The tools, each checked: a JSON object with a valid `name` and object `parameters`."""
        found = []
        for k, given in enumerate(self.tools or ()):
            try:
                tool = json.loads(given)
            except ValueError:
                tool = None
            if (
                not isinstance(tool, dict)
                or not isinstance(name := tool.get("name"), str)
                or not re.match(TOOL_NAME, name)
                or not isinstance(tool.get("parameters", {}), dict)
            ):
                raise RequestRefused(
                    f"tools[{k}] must be a JSON object with a name (letters, digits, _ and -, "
                    "at most 64) and object parameters", "invalid_value",
                )  # fmt: skip
            found.append(tool)
        if self.tool_name is not None and self.tool_name not in {t["name"] for t in found}:
            raise RequestRefused(
                f"tool_name {self.tool_name!r} is none of the tools", "invalid_value"
            )
        return found

    def shape(self) -> dict[str, Any] | None:
        """llama.cpp's `response_format`, or None for free text."""
        if self.response_format == "json_object":
            return {"type": "json_object"}
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError:
                schema = None
            if not isinstance(schema, dict):
                raise RequestRefused("json_schema must be a JSON object", "invalid_value")
            return {"type": "json_schema", "json_schema": {"schema": schema}}
        return None


def chat_messages(data: Any, system_prompt: str | None) -> list[dict[str, str]]:
    """The conversation for llama.cpp's chat template: a string is one user turn. One it
    cannot take is refused: the client's to fix (a 400 over HTTP), not the stage's fault."""
    try:
        if isinstance(data, str):
            if not data.strip() or len(data) > MAX_PROMPT_CHARS:
                raise RequestRefused(
                    f"the prompt must be 1 to {MAX_PROMPT_CHARS} characters", "invalid_value"
                )
            messages = [ChatMessage(role="user", content=data)]
        else:
            messages = ChatPrompt.model_validate(data).messages
    except ValidationError as e:
        raise RequestRefused(
            f"not a prompt (a string, or {{'messages': [...]}}): {in_words(e)}", "invalid_value"
        ) from None
    out = [m.model_dump() for m in messages]
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def request_body(
    request_id: str,
    data: Any,
    params: dict[str, Any] | None,
    defaults: SamplingParams,
    system_prompt: str | None,
) -> tuple[dict[str, Any], bool]:
    """llama.cpp's request, and whether a conversation too long for it is cut to fit."""
    try:
        given = SamplingParams.model_validate(params or {})
    except ValidationError as e:
        raise RequestRefused(f"bad request parameters: {in_words(e)}", "invalid_value") from None
    d = defaults
    messages = chat_messages(data, system_prompt)
    body: dict[str, Any] = {
        "messages": messages,
        "stream": True,
        "max_tokens": given.max_tokens or d.max_tokens,
        "temperature": d.temperature if given.temperature is None else given.temperature,
        "top_p": given.top_p or d.top_p,
        "stop": given.stop,
        "seed": zlib.crc32(request_id.encode()) if given.seed is None else given.seed,
        "stream_options": {"include_usage": True},
    }
    for penalty in ("frequency_penalty", "presence_penalty"):
        value = getattr(given, penalty)
        if value is not None:  # else llama.cpp's own default (0: none)
            body[penalty] = value
    if (shape := given.shape()) is not None:
        body["response_format"] = shape
    if given.tools is not None:
        tools = given.tool_list()
        required = given.tool_choice == "required" or given.tool_name is not None
        schema = answer_schema(
            tools, required, given.tool_name, given.parallel_tool_calls is not False
        )
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
        body["messages"] = told(messages, tools_instructions(tools, required))
    return body, given.truncation == "auto"


def told(messages: list[dict[str, str]], instructions: str) -> list[dict[str, str]]:
    """The conversation with `instructions` ending its system message (a new one if none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{instructions}"}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


async def read_calls(
    answer: AsyncIterator[Any], halt: Callable[[], None] | None = None
) -> AsyncIterator[Any]:
    """An answer asked with tools, read in its shape: its text as it is written, each call
    as soon as it is whole (an output `{"tool_calls": [...]}`), then a `Final` with the rest
    (`finish_reason` "tool_calls" once a call was made, unless the answer was cut).

    With `halt`, a call the answer made already ends it: `halt` stops the decoding, and
    what comes after is dropped (`AnswerReader`); without, repeats are calls like others."""
    reader = AnswerReader(keep_repeats=halt is None)
    async for piece in answer:
        if not isinstance(piece, Final):
            if reader.looping:
                continue  # decoded before the halt took hold: the answer has ended
            if text := reader.feed(piece):
                yield text
            if calls := reader.take_calls():
                yield calls_output(calls)
            if reader.looping and halt is not None:
                halt()
            continue
        if reader.looping:  # its calls all went out as they closed
            yield Final("", "tool_calls", piece.usage)
            return
        rest = reader.feed(piece.data) if isinstance(piece.data, str) else ""
        calls = reader.take_calls()
        reason = piece.finish_reason
        if reader.called and reason != "length":
            reason = "tool_calls"
        yield Final(calls_output(calls) if calls else rest, reason, piece.usage)
