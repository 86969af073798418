"""A Realtime client event that fails validation names the field a client sent, as the
HTTP errors do: pydantic's tags for the members of a union are no part of it."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from omni_runtime.http.realtime_audio import AudioType, InputDecoder, OutputEncoder
from omni_runtime.http.realtime_events import (
    CallItem,
    CallOutputItem,
    EventError,
    ItemCreate,
    NamedTool,
    RealtimeTool,
    SessionUpdate,
    checked_tools,
    parse_client_event,
)


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ({"audio": {"output": {"voice": 12}}}, "session.audio.output.voice"),
        ({"audio": {"output": {"voice": {"id": 12}}}}, "session.audio.output.voice"),
        ({"max_output_tokens": -5}, "session.max_output_tokens"),
        ({"output_modalities": ["video"]}, "session.output_modalities.0"),
        ({"truncation": "sometimes"}, "session.truncation"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "session.tools.0.name"),
        ({"tools": [{"type": "web_search", "name": "f"}]}, "session.tools.0.type"),
        ({"tool_choice": {"type": "function"}}, "session.tool_choice"),
        ({"tool_choice": "sometimes"}, "session.tool_choice"),
    ],
)
def test_a_bad_session_update_names_the_field(session: dict[str, Any], param: str) -> None:
    with pytest.raises(EventError) as caught:
        parse_client_event(json.dumps({"type": "session.update", "session": session}))
    assert caught.value.param == param
    assert str(caught.value).startswith(f"session.update: {param}: ")


def test_an_unknown_audio_format_names_the_field() -> None:
    session = {"audio": {"input": {"format": {"type": "audio/g729"}}}}
    with pytest.raises(EventError) as caught:
        parse_client_event(json.dumps({"type": "session.update", "session": session}))
    assert caught.value.param == "session.audio.input.format"
    assert "audio/pcmu" in str(caught.value)  # what it may be


@pytest.mark.parametrize("kind", ["audio/pcmu", "audio/pcma"])
def test_g711_in_is_24_khz_pcm16_and_out_is_8_khz_g711(kind: AudioType) -> None:
    """A second of tone each way, in 20 ms pieces as a phone line sends them: as long, and
    the same tone (G.711 keeps 8 kHz speech to within a few per cent)."""
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(8000) / 8000)).astype(np.float32)
    encode = OutputEncoder(kind, 8000)
    coded = [encode(piece) for piece in np.split(tone, 50)] + [encode.flush()]
    line = b"".join(data for data, _n in coded)
    assert sum(n for _data, n in coded) == len(line) == 8000  # one byte a sample
    decode = InputDecoder(kind)
    heard = np.frombuffer(b"".join(decode(line[i : i + 160]) for i in range(0, 8000, 160)), "<i2")
    assert 24000 - 1200 <= heard.size <= 24000  # the resampler holds its last ms (< 50)
    wide = (0.3 * np.sin(2 * np.pi * 440 * np.arange(heard.size) / 24000)) * 32767
    lag = int(np.argmax(np.correlate(heard[:2400].astype(float), wide[:2400], "full"))) - 2399
    assert abs(lag) < 48  # under 2 ms: the resampler's delay
    assert np.abs(heard).max() == pytest.approx(0.3 * 32767, rel=0.05)


def test_pcm_in_is_taken_as_it_is_whole_samples_only() -> None:
    decode = InputDecoder("audio/pcm")
    assert decode(b"\x01\x02\x03\x04") == b"\x01\x02\x03\x04"
    with pytest.raises(ValueError, match="odd byte count"):
        decode(b"\x01\x02\x03")


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip


def test_tools_are_flat_functions_and_calls_and_their_outputs_are_items() -> None:
    update = parse_client_event(json.dumps({"type": "session.update", "session": {
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}}))  # fmt: skip
    assert isinstance(update, SessionUpdate) and update.session.tools is not None
    (tool,) = update.session.tools
    assert json.loads(tool.stage_form()) == {k: v for k, v in WEATHER.items() if k != "type"}
    assert update.session.tool_choice == NamedTool(type="function", name="get_weather")
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    made = parse_client_event(json.dumps({"type": "conversation.item.create", "item": call}))
    assert isinstance(made, ItemCreate) and isinstance(made.item, CallItem)
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    given = parse_client_event(json.dumps({"type": "conversation.item.create", "item": output}))
    assert isinstance(given, ItemCreate) and isinstance(given.item, CallOutputItem)
    with pytest.raises(EventError) as caught:
        bad = {"type": "function_call_output", "output": "no call"}
        parse_client_event(json.dumps({"type": "conversation.item.create", "item": bad}))
    assert caught.value.param == "item.call_id"


def test_tools_a_model_cannot_call_or_a_choice_among_none_are_refused() -> None:
    tools = [RealtimeTool.model_validate(WEATHER)]
    checked_tools(tools, "auto", "session", "voice", calls=True)
    checked_tools(tools, "none", "session", "omni", calls=False)  # none: nothing is called
    checked_tools([], "auto", "session", "omni", calls=False)
    with pytest.raises(EventError, match="calls no tools") as caught:
        checked_tools(tools, "auto", "response", "omni", calls=False)
    assert (caught.value.param, caught.value.code) == ("response.tools", "unsupported_parameter")
    with pytest.raises(EventError, match="none of the tools"):
        checked_tools(tools, NamedTool(type="function", name="clock"), "session", "voice", True)
    with pytest.raises(EventError, match="needs tools"):
        checked_tools([], "required", "session", "voice", calls=True)
