"""A request's voice and speed win over the stage's options, and bad values are refused."""

from __future__ import annotations

from typing import Any

import pytest

from omni_runtime.engines.voice_params import voice_params


def test_request_params_win_over_the_options() -> None:
    chosen = voice_params({"voice": "joe", "speed": 2, "max_tokens": 9}, "en-us", 1.0)
    assert (chosen.voice, chosen.speed) == ("joe", 2.0)


def test_the_options_stand_when_the_request_names_nothing() -> None:
    for params in (None, {}, {"voice": None, "temperature": 0.2}):
        chosen = voice_params(params, "en-us", 1.5)
        assert (chosen.voice, chosen.speed) == ("en-us", 1.5)


@pytest.mark.parametrize(
    "params",
    [{"speed": 0.2}, {"speed": 4.5}, {"speed": True}, {"speed": "2"}, {"speed": float("inf")},
     {"voice": ""}, {"voice": 3}, {"voice": "x" * 200}],
)  # fmt: skip
def test_bad_values_fail_with_what_was_wrong(params: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"bad voice parameters: (speed|voice)"):
        voice_params(params, None, 1.0)


def test_the_speed_bounds_are_inclusive() -> None:
    assert voice_params({"speed": 0.25}, None, 1.0).speed == 0.25
    assert voice_params({"speed": 4}, None, 1.0).speed == 4.0


def test_params_must_be_a_dict() -> None:
    with pytest.raises(ValueError, match="must be a dict"):
        voice_params(["fast"], None, 1.0)  # type: ignore[arg-type]


def test_an_openai_voice_the_stage_does_not_map_keeps_the_stages_voice() -> None:
    assert voice_params({"voice": "alloy", "speed": 2}, "en-us", 1.0).voice == "en-us"
    assert voice_params({"voice": "marin"}, None, 1.0).voice is None  # the stage's default
    mapped = voice_params({"voice": "alloy"}, "en-us", 1.0, known={"alloy": "en-gb"})
    assert mapped.voice == "alloy"  # the stage's `voices` says what it is
    assert voice_params({"voice": "alloys"}, "en-us", 1.0).voice == "alloys"  # not OpenAI's
