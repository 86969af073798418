"""Stage code that misbehaves on purpose, for the tests of what the runtime does about it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omni_runtime.stage_api import EngineOutput, StepFailed


def emits_a_set(data: Any) -> Iterator[Any]:
    """A set cannot travel (msgpack has none): the request must fail, not the worker."""
    yield "fine"
    yield {1, 2}
    yield "never sent"


class Picky:
    """A step engine that upper-cases word lists and refuses some inputs, in two ways.

    `add_request` raises on "bad-add"; `step` raises `StepFailed` naming the request
    holding "bad-step": only those requests may fail, never the worker or the others.
    """

    def __init__(self) -> None:
        self._held: dict[str, list[str]] = {}

    def add_request(self, request_id: str, data: Any) -> None:
        words = [str(w) for w in data]
        if "bad-add" in words:
            raise ValueError("refusing bad-add")
        self._held[request_id] = words

    def has_work(self) -> bool:
        return bool(self._held)

    def step(self) -> list[EngineOutput]:
        held, self._held = self._held, {}
        bad = [rid for rid, words in held.items() if "bad-step" in words]
        if bad:
            self._held = {rid: w for rid, w in held.items() if rid not in bad}
            raise StepFailed(bad, "refusing bad-step")
        return [EngineOutput(rid, [w.upper() for w in words], True) for rid, words in held.items()]

    def abort(self, request_id: str) -> None:
        self._held.pop(request_id, None)
