"""`settings_env`: the settings `run` and `serve` were given, as the variables of the
processes they start, read back there as they were (the end-to-end path:
tests/e2e/test_run_settings.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omni_runtime.local.launcher import child_env, settings_env
from omni_runtime.settings import Settings
from tests.every_setting import NON_DEFAULT


def in_child(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings a child started with `env` reads (no flags, no file)."""
    for name in [n for n in os.environ if n.startswith("OMNI_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("OMNI_"):
            monkeypatch.setenv(name, value)
    return Settings.load()


def test_the_list_of_settings_covers_every_setting() -> None:
    assert set(NON_DEFAULT) == set(Settings.model_fields)


def test_every_setting_reaches_the_child_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    given = Settings(**NON_DEFAULT)
    child = in_child(child_env(NON_DEFAULT["redis_url"], settings_env(given)), monkeypatch)
    assert child.model_dump() == given.model_dump()
    defaults = {name: field.default for name, field in Settings.model_fields.items()}
    assert [n for n, value in child.model_dump().items() if value == defaults[n]] == []


def test_values_pydantic_reads_only_in_one_spelling_survive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    given = Settings(deadline_s=1e-05, trace=False, trace_file=Path("/tmp/t r"))
    child = in_child(child_env("redis://h:1/0", settings_env(given)), monkeypatch)
    assert child.deadline_s == 1e-05 and child.trace is False
    assert child.trace_file == Path("/tmp/t r")


def test_what_the_parent_had_unset_or_read_from_a_file_is_not_read_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A variable the parent's flags overrode with None, and the settings file (already
    applied in the parent, beneath its variables), are gone from the child's environment."""
    settings_file = tmp_path / "settings.yaml"
    settings_file.write_text("deadline_s: 7\n")
    monkeypatch.setenv("OMNI_SETTINGS_FILE", str(settings_file))
    monkeypatch.setenv("OMNI_TRACE_FILE", "/tmp/parent.trace")
    given = Settings(trace_file=None, deadline_s=9)
    env = child_env("redis://h:1/0", settings_env(given))
    assert "OMNI_SETTINGS_FILE" not in env and "OMNI_TRACE_FILE" not in env
    assert env["OMNI_DEADLINE_S"] == "9.0" and env["OMNI_REDIS_URL"] == "redis://h:1/0"
