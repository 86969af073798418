"""Stage code that misbehaves on purpose, for the tests of what the runtime does about it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def emits_a_set(data: Any) -> Iterator[Any]:
    """A set cannot travel (msgpack has none): the request must fail, not the worker."""
    yield "fine"
    yield {1, 2}
    yield "never sent"
