"""A Realtime client event that fails validation names the field a client sent, as the
HTTP errors do: pydantic's tags for the members of a union are no part of it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from omni_runtime.http.realtime_events import EventError, parse_client_event


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ({"audio": {"output": {"voice": 12}}}, "session.audio.output.voice"),
        ({"audio": {"output": {"voice": {"id": 12}}}}, "session.audio.output.voice"),
        ({"max_output_tokens": -5}, "session.max_output_tokens"),
        ({"output_modalities": ["video"]}, "session.output_modalities.0"),
        ({"truncation": "sometimes"}, "session.truncation"),
    ],
)
def test_a_bad_session_update_names_the_field(session: dict[str, Any], param: str) -> None:
    with pytest.raises(EventError) as caught:
        parse_client_event(json.dumps({"type": "session.update", "session": session}))
    assert caught.value.param == param
    assert str(caught.value).startswith(f"session.update: {param}: ")
