"""Function calling between the front door and a text stage, for any model that can be held
to a JSON schema (llama.cpp's grammars): the model answers with one JSON value, either a
string, its text (`"<text>"`), or a list of calls (`[{"name": ..., "arguments": {...}}]`),
the schema built from the request's tools admitting only those shapes (only calls, when a
call is required). The conversation's earlier calls and their results are written back
as plain sentences (a small model given its calls back as JSON repeats that JSON as its
next answer, spoken). A string's opening is one token: the text's first words are not held up by a
wrapper (`{"content": "` was five, and 2.8x the first words' wait, `docs/engines.md`).

Pure: the front door builds the stage's parameters and the history with it, the stage
its schema, its instructions and its reading of the answer as it is written, so that the
text of an answer is spoken while it is written and a call never is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
"""What a function's name may be (OpenAI's rule)."""
TOOL_CALLS = "tool_calls"
"""The key of a text stage's output that carries calls."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments, a JSON object's text (as OpenAI's API gives them)."""


def answer_schema(
    tools: list[dict[str, Any]], required: bool, only: str | None, parallel: bool
) -> dict[str, Any]:
    """The JSON schema of an answer: calls of `tools` (each `{"name", "parameters", ...}`;
    only the one named `only`, if given), or text too unless a call is `required`."""
    chosen = [t for t in tools if only is None or t["name"] == only]
    call_shapes = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                "arguments": t.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    calls: dict[str, Any] = {"type": "array", "items": {"anyOf": call_shapes}, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    if required or only is not None:
        return calls
    return {"anyOf": [{"type": "string"}, calls]}


def tools_instructions(tools: list[dict[str, Any]], required: bool) -> str:
    """What the model is told of its tools and of the shape of its answer."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    shapes = 'a list of calls, [{"name": "<a tool\'s name>", "arguments": {<its arguments>}}]'
    when = ""
    if not required:
        shapes = 'your answer as a string, "<your answer>", or ' + shapes
        when = "Call a tool only when the user's question needs what it returns; otherwise answer yourself.\n"
    return f"You can call these tools:\n{listed}\n{when}Answer with JSON: {shapes}"


def written_calls(calls: list[ToolCall]) -> str:
    """Earlier calls, as the model reads them back (an assistant message of the history)."""
    return "Let me call " + " and ".join(f"{c.name} with {c.arguments}" for c in calls) + "."


def written_result(name: str | None, content: str) -> str:
    """A tool's result, as the model reads it (a user message of the history)."""
    return f"Result of {name or 'a tool'}: {content}"


def calls_output(calls: list[ToolCall]) -> dict[str, Any]:
    """A text stage's output carrying calls."""
    return {TOOL_CALLS: [{"name": c.name, "arguments": c.arguments} for c in calls]}


def calls_in(data: Any) -> list[ToolCall] | None:
    """The calls a text stage's output carries, or None if it is not calls."""
    if not isinstance(data, dict) or not isinstance(found := data.get(TOOL_CALLS), list):
        return None
    if not found:
        return None
    calls = []
    for call in found:
        if not isinstance(call, dict):
            return None
        name, arguments = call.get("name"), call.get("arguments")
        if not isinstance(name, str) or not isinstance(arguments, str):
            return None
        calls.append(ToolCall(name, arguments))
    return calls


_OPENING = re.compile(r'\s*(["\[])')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class AnswerReader:
    """Reads an answer in the shape above as it is written: its text as it comes, each of
    its calls as soon as that call's object is whole (so a call cut off by the token
    limit loses only itself).

    A call the same as one the answer made already (its name and arguments) is a small
    model looping (SmolLM2 repeats its call until its token limit): unless `keep_repeats`,
    it is not taken, and `looping` says the answer is worth no more decoding."""

    def __init__(self, keep_repeats: bool = False) -> None:
        self.keep_repeats = keep_repeats
        self.repeated = False
        self._made: set[tuple[str, str]] = set()
        self._raw = ""
        self._kind: str | None = None
        """`"`: the answer is text; `[`: calls."""
        self._at = 0
        """Where what is not yet read starts: in the text, or in the list of calls."""
        self._text_done = False
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._call_start = 0
        self._calls: list[ToolCall] = []
        self._given = 0
        """Calls already taken (`take_calls`)."""

    def feed(self, piece: str) -> str:
        """The text the answer's content gained with `piece` ("" for calls)."""
        self._raw += piece
        if self._kind is None:
            opened = _OPENING.match(self._raw)
            if opened is None:
                return ""  # only spaces so far
            self._kind, self._at = opened.group(1), opened.end()
        if self._kind == "[":
            self._scan_calls()
            return ""
        if self._text_done:
            return ""
        return self._decode()

    def _scan_calls(self) -> None:
        """Each call object closed since the last scan, parsed."""
        raw = self._raw
        for i in range(self._at, len(raw)):
            ch = raw[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch == "{":
                if self._depth == 0:
                    self._call_start = i
                self._depth += 1
            elif ch == "}":
                self._depth -= 1
                if self._depth == 0:
                    self._read_call(raw[self._call_start : i + 1])
        self._at = len(raw)

    def _read_call(self, text: str) -> None:
        try:
            call = json.loads(text)
            made = ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False))
        except (ValueError, LookupError, TypeError):
            return  # not the shape asked (the grammar allows no other): nothing to call
        if not isinstance(made.name, str):
            return
        same = (made.name, json.dumps(call["arguments"], sort_keys=True))
        if same in self._made:
            self.repeated = True
            if not self.keep_repeats:
                return
        self._made.add(same)
        self._calls.append(made)

    def _decode(self) -> str:
        out: list[str] = []
        raw, i = self._raw, self._at
        while i < len(raw):
            ch = raw[i]
            if ch == '"':
                self._text_done = True
                i += 1
                break
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            if i + 1 >= len(raw):
                break  # the escape's next character is yet to come
            kind = raw[i + 1]
            if kind == "u":
                if i + 6 > len(raw):
                    break
                code = int(raw[i + 2 : i + 6], 16)
                if 0xD800 <= code < 0xDC00:  # a surrogate pair: its second half follows
                    if i + 12 > len(raw):
                        break
                    low = int(raw[i + 8 : i + 12], 16)
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    i += 12
                    continue
                out.append(chr(code))
                i += 6
                continue
            out.append(_ESCAPES.get(kind, kind))
            i += 2
        self._at = i
        return "".join(out)

    def take_calls(self) -> list[ToolCall]:
        """The calls made whole since the last take."""
        taken = self._calls[self._given :]
        self._given = len(self._calls)
        return taken

    @property
    def looping(self) -> bool:
        """A call was repeated, and repeats are not kept: the answer has ended."""
        return self.repeated and not self.keep_repeats

    @property
    def called(self) -> bool:
        """Whether the answer has made a whole call."""
        return bool(self._calls)
