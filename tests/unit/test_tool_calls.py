"""Function calling's shape between the front door and a text stage (`core/tool_calls.py`):
the schema an answer is held to, and its reading as it is written."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omni_runtime.core.tool_calls import (
    AnswerReader,
    ToolCall,
    answer_schema,
    calls_in,
    calls_output,
    tools_instructions,
    written_calls,
    written_result,
)
from omni_runtime.engines.chat_request import read_calls
from omni_runtime.stage_api import Final, TokenUsage

WEATHER = {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
ADD = {"name": "add", "description": "Add two numbers"}


def read_in_pieces(answer: str, size: int) -> tuple[str, AnswerReader]:
    """Feeds `answer` `size` characters at a time; the text it gave, and the reader."""
    reader = AnswerReader()
    text = "".join(reader.feed(answer[i : i + size]) for i in range(0, len(answer), size))
    return text, reader


@pytest.mark.parametrize("size", [1, 2, 3, 5, 1000])
def test_the_text_of_an_answer_comes_as_it_is_written_whatever_its_pieces(size: int) -> None:
    said = 'Say "hi"\\\\ then\nleave: caf\u00e9 \u2603 \U0001f600 \t/ end'
    answer = " " + json.dumps(said)  # escapes, \\u pairs
    text, reader = read_in_pieces(answer, size)
    assert text == said
    assert reader.take_calls() == [] and not reader.called
    ascii_answer = json.dumps(said, ensure_ascii=True)
    assert read_in_pieces(ascii_answer, size)[0] == said


def test_text_waits_for_its_opening_and_stops_at_its_closing_quote() -> None:
    reader = AnswerReader()
    assert reader.feed(" \n") == ""
    assert reader.feed('"Hel') == "Hel"
    assert reader.feed('lo"') == "lo"
    assert reader.feed(" ") == ""
    assert not reader.called


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_calls_say_nothing_and_each_is_read_once_whole(size: int) -> None:
    first = '{"name": "add", "arguments": {"a": 2, "b": "x\\"y}{"}}'
    second = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    answer = f"\n [{first}, {second}]"
    reader, text, taken = AnswerReader(), "", []
    for i in range(0, len(answer), size):
        text += reader.feed(answer[i : i + size])
        taken.append((i + size, reader.take_calls()))
    assert text == ""
    made = [(at, calls) for at, calls in taken if calls]
    add = ToolCall("add", json.dumps({"a": 2, "b": 'x"y}{'}))
    assert [c for _at, calls in made for c in calls] == [
        add,
        ToolCall("get_weather", '{"city": "Oslo"}'),
    ]
    if size == 1:  # each as soon as its object closed, not with the answer's end
        assert made[0][0] == answer.index(first) + len(first)
    assert reader.called and reader.take_calls() == []


def test_an_answer_cut_short_keeps_its_whole_calls_and_the_text_it_had() -> None:
    cut, reader = read_in_pieces('[{"name": "add", "argu', 3)
    assert cut == "" and not reader.called
    whole = '{"name": "add", "arguments": {"a": 1}}'
    _cut, reader = read_in_pieces(f'[{whole}, {{"name": "add", "argu', 3)
    assert reader.take_calls() == [ToolCall("add", '{"a": 1}')]
    text, reader = read_in_pieces('"It is sun', 3)
    assert text == "It is sun" and not reader.called
    assert not read_in_pieces("", 1)[1].called


def test_a_call_made_again_is_not_taken_and_says_the_answer_loops() -> None:
    """The same name and arguments (their keys in any order): a small model looping; a
    call of other arguments is a call."""
    oslo = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}'
    again = '{"name": "get_weather", "arguments": {"days": 1, "city": "Oslo"}}'
    bergen = '{"name": "get_weather", "arguments": {"city": "Bergen", "days": 1}}'
    _text, reader = read_in_pieces(f"[{oslo}, {bergen}]", 4)
    assert len(reader.take_calls()) == 2 and not reader.repeated
    _text, reader = read_in_pieces(f"[{oslo}, {again}, {oslo}", 4)
    assert reader.take_calls() == [ToolCall("get_weather", '{"city": "Oslo", "days": 1}')]
    assert reader.repeated
    kept = AnswerReader(keep_repeats=True)
    kept.feed(f"[{oslo}, {again}]")
    assert len(kept.take_calls()) == 2 and kept.repeated


async def pieces_of(answer: list[Any]) -> AsyncIterator[Any]:
    for piece in answer:
        yield piece


async def test_a_repeated_call_halts_the_answer_and_ends_it_with_its_calls_made() -> None:
    """`read_calls` with a halt: the decoding is stopped at the first repeat, what was
    decoded after it is dropped, and the answer ends as a call's does, with its counts."""
    oslo = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    halted: list[bool] = []
    answer = ["[", oslo, ", ", oslo, ", ", oslo, "]", Final("", "length", TokenUsage(9, 60))]
    outs = [o async for o in read_calls(pieces_of(answer), lambda: halted.append(True))]
    assert halted == [True]
    assert outs == [
        calls_output([ToolCall("get_weather", '{"city": "Oslo"}')]),
        Final("", "tool_calls", TokenUsage(9, 60)),
    ]
    outs = [o async for o in read_calls(pieces_of(answer))]  # no halt: every call kept
    assert [o for o in outs if not isinstance(o, Final)] == [calls_output(
        [ToolCall("get_weather", '{"city": "Oslo"}')])] * 3  # fmt: skip
    assert outs[-1] == Final("", "length", TokenUsage(9, 60))


def test_a_required_call_admits_only_calls_of_the_tools() -> None:
    schema = answer_schema([WEATHER, ADD], required=True, only=None, parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert "maxItems" not in schema
    shapes = schema["items"]["anyOf"]
    assert [s["properties"]["name"] for s in shapes] == [{"const": "get_weather"}, {"const": "add"}]
    assert shapes[0]["properties"]["arguments"] == WEATHER["parameters"]
    assert shapes[1]["properties"]["arguments"] == {"type": "object"}  # none given


def test_auto_admits_text_or_calls_a_named_tool_only_it_and_one_call_if_not_parallel() -> None:
    auto = answer_schema([WEATHER, ADD], required=False, only=None, parallel=False)
    text, calls = auto["anyOf"]
    assert text == {"type": "string"}
    assert calls["type"] == "array" and calls["maxItems"] == 1
    named = answer_schema([WEATHER, ADD], required=False, only="add", parallel=True)
    shapes = named["items"]["anyOf"]
    assert [s["properties"]["name"]["const"] for s in shapes] == ["add"]


def test_the_instructions_list_every_tool_and_the_shapes_allowed() -> None:
    told = tools_instructions([WEATHER, ADD], required=False)
    assert json.dumps(WEATHER) in told and json.dumps(ADD) in told
    assert '"<your answer>"' in told and '[{"name":' in told
    assert "a string" not in tools_instructions([WEATHER], required=True)


def test_calls_travel_as_an_output_and_are_written_back_as_they_were_made() -> None:
    calls = [ToolCall("add", '{"a": 1}'), ToolCall("get_weather", '{"city": "Oslo"}')]
    assert calls_in(calls_output(calls)) == calls
    assert written_calls(calls) == (
        'Let me call add with {"a": 1} and get_weather with {"city": "Oslo"}.'
    )
    assert written_result("add", "3") == "Result of add: 3"
    assert written_result(None, "3") == "Result of a tool: 3"


@pytest.mark.parametrize(
    "data",
    ["text", None, {"text": "timed"}, {"tool_calls": "x"}, {"tool_calls": [{"name": 1}]},
     {"tool_calls": [{"name": "f", "arguments": {}}]}, {"tool_calls": ["f"]}, {"tool_calls": []}],
)  # fmt: skip
def test_what_is_not_calls_is_not_read_as_calls(data: Any) -> None:
    assert calls_in(data) is None
