"""Function calling's OpenAI shapes: the tools a chat offers, its choice, the calls an
assistant made and the results sent back, and the calls of an answer, whole or streamed;
with what they become for the text stage (its parameters, the history as text: the
format of `core/tool_calls.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_runtime.core.tool_calls import TOOL_NAME, ToolCall, written_calls, written_result
from omni_runtime.core.types import MAX_PARAM_STR_CHARS, param_json

MAX_ARGUMENTS_CHARS = 65_536
ToolName = Annotated[str, Field(pattern=TOOL_NAME)]


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDef(_In):
    name: ToolName
    description: Annotated[str, Field(max_length=MAX_PARAM_STR_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of an object; none: the function takes no arguments."""
    strict: bool | None = None
    """Accepted: the arguments always follow `parameters`, held by the stage's grammar."""

    def stage_form(self) -> str:
        """The function as the text stage reads it: compact JSON, a parameter's size."""
        shown: dict[str, Any] = {"name": self.name}
        if self.description:
            shown["description"] = self.description
        shown["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return param_json(shown)

    @field_validator("parameters")
    @classmethod
    def _an_object_schema_of_a_param_size(
        cls, schema: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        if schema is not None and schema.get("type", "object") != "object":
            raise ValueError("a function's parameters are a JSON schema of type 'object'")
        if schema is not None and len(param_json(schema)) > MAX_PARAM_STR_CHARS // 2:
            raise ValueError(
                f"a function's parameters must be at most {MAX_PARAM_STR_CHARS // 2} "
                "characters of JSON"
            )
        return schema

    @model_validator(mode="after")
    def _fits_a_param(self) -> FunctionDef:
        if len(self.stage_form()) > MAX_PARAM_STR_CHARS:
            raise ValueError(
                f"a function must be at most {MAX_PARAM_STR_CHARS} characters of JSON "
                "(its name, description and parameters)"
            )
        return self


class FunctionTool(_In):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_In):
    name: ToolName


class NamedToolChoice(_In):
    """`{"type": "function", "function": {"name": ...}}`: the answer calls that function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_params(
    functions: Sequence[FunctionDef],
    choice: str | None,
    named: str | None = None,
    parallel: bool | None = None,
) -> dict[str, Any]:
    """The text stage's parameters for the functions a request offers (none when it may call
    none: `choice` "none"): `choice` "required", or the one function `named`."""
    if not functions or choice == "none":
        return {}
    given: dict[str, Any] = {"tools": [f.stage_form() for f in functions]}
    if named is not None:
        given["tool_name"] = named
    elif choice == "required":
        given["tool_choice"] = "required"
    if parallel is False:
        given["parallel_tool_calls"] = False
    return given


def chat_tool_params(
    tools: list[FunctionTool] | None, choice: ToolChoice | None, parallel: bool | None
) -> dict[str, Any]:
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    plain = choice if isinstance(choice, str) else None
    return tool_params([t.function for t in tools or ()], plain, named, parallel)


def unknown_choice(tools: list[FunctionTool] | None, choice: ToolChoice | None) -> str | None:
    """Why a chat's `tool_choice` cannot be honoured with its tools, if it cannot."""
    if choice not in (None, "none") and not tools:
        return "tool_choice needs tools"  # even `auto`, as OpenAI's chat endpoint says
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    plain = choice if isinstance(choice, str) else None
    return choice_problem({t.function.name for t in tools or ()}, plain, named)


def choice_problem(names: set[str], choice: str | None, named: str | None) -> str | None:
    """Why a choice (`choice`, or the function `named`) cannot be made among the functions
    `names`, if it cannot (the chat's and the Realtime session's rule)."""
    if named is not None and named not in names:
        return f"tool_choice names {named!r}, which is none of the tools"
    if (named is not None or choice not in (None, "none", "auto")) and not names:
        return "tool_choice needs tools"
    return None


# --- the history: calls made, results given -------------------------------------


class CalledFunction(_In):
    name: ToolName
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENTS_CHARS)]


class CallMade(_In):
    """An assistant message's call, as the client sends its history back."""

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction


def calls_written(calls: list[CallMade]) -> str:
    """An assistant message's calls as its text in the history."""
    return written_calls([ToolCall(c.function.name, c.function.arguments) for c in calls])


def result_written(call_id: str | None, content: str, names: dict[str, str]) -> str:
    """A tool message as its text in the history, naming the function it answers."""
    return written_result(names.get(call_id or ""), content)


# --- answers ----------------------------------------------------------------------


class FunctionCalled(BaseModel):
    name: str
    arguments: str


class CallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCalled


class CallDelta(BaseModel):
    """A streamed call: each comes whole, in one delta (OpenAI's clients join the
    arguments of deltas of the same `index`, one delta of them is theirs whole)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCalled


def call_id(request_id: str, k: int) -> str:
    return f"call_{request_id}_{k}"


def calls_out(request_id: str, calls: list[ToolCall], first: int = 0) -> list[CallOut]:
    """The calls as an answer's, `first` the index of the first among all of them."""
    return [
        CallOut(
            id=call_id(request_id, k), function=FunctionCalled(name=c.name, arguments=c.arguments)
        )
        for k, c in enumerate(calls, first)
    ]


def call_deltas(request_id: str, calls: list[ToolCall], first: int = 0) -> list[CallDelta]:
    return [
        CallDelta(index=first + k, id=out.id, function=out.function)
        for k, out in enumerate(calls_out(request_id, calls, first))
    ]
