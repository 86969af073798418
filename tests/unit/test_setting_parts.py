"""Each part's own settings, as its shell takes them (`Settings.part`): every field is the
setting of its name, so a value given to a setting reaches the part."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from omni_runtime.http.sockets import RealtimeSettings
from omni_runtime.keys import Names
from omni_runtime.observe.start import ObserveSettings
from omni_runtime.orchestrator.shared import SlotSettings
from omni_runtime.redis_io.backoff import RetrySettings
from omni_runtime.settings import Settings
from omni_runtime.worker.io_threads import ReaderSettings
from omni_runtime.worker.takeover import TakeoverSettings
from tests.every_setting import NON_DEFAULT

SETTINGS = Settings(**NON_DEFAULT)
RETRY = SETTINGS.part(RetrySettings)
PARTS: list[tuple[type[Any], dict[str, Any]]] = [
    (RetrySettings, {}),
    (ReaderSettings, {"retry": RETRY}),
    (TakeoverSettings, {"retry": RETRY}),
    (SlotSettings, {"retry": RETRY}),
    (ObserveSettings, {}),
    (RealtimeSettings, {}),
]


@pytest.mark.parametrize(("cls", "also"), PARTS, ids=[cls.__name__ for cls, _ in PARTS])
def test_a_part_takes_each_setting_of_its_fields(cls: type[Any], also: dict[str, Any]) -> None:
    part = SETTINGS.part(cls, **also)
    for f in fields(cls):
        expected = also[f.name] if f.name in also else getattr(SETTINGS, f.name)
        got = getattr(part, f.name)
        if isinstance(expected, Names):  # a namespace's names: the namespace given
            expected, got = expected.namespace, got.namespace
        assert got == expected, f.name
        if f.name in NON_DEFAULT:  # given another value than its default: it arrived
            assert expected != Settings.model_fields[f.name].default, f.name


def test_the_retry_settings_draw_bounded_and_unbounded_backoffs() -> None:
    assert RETRY.backoff().max_attempts is None
    bounded = RETRY.backoff(bounded=True)
    assert (bounded.initial_s, bounded.max_s, bounded.max_attempts) == (
        NON_DEFAULT["retry_initial_s"],
        NON_DEFAULT["retry_max_s"],
        NON_DEFAULT["retry_attempts"],
    )
