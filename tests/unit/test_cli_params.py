"""`--param KEY=VALUE` on `run` and `submit`: a request's parameters from the command line."""

from __future__ import annotations

import pytest

from omni_runtime.cli.console import parse_params
from omni_runtime.errors import ConfigError


def test_values_are_json_where_they_parse_else_text() -> None:
    pairs = ["max_tokens=40", "temperature=0.2", 'stop=["."]', "voice=joe", "seed=7", "x=a=b"]
    assert parse_params(pairs) == {
        "max_tokens": 40, "temperature": 0.2, "stop": ["."], "voice": "joe", "seed": 7, "x": "a=b",
    }  # fmt: skip
    assert parse_params([]) is None


@pytest.mark.parametrize("bad", ["max_tokens", "=3", " =3"])
def test_a_pair_without_a_key_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_params([bad])
