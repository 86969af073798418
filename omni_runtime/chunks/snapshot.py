"""The default snapshot of `save_async` (SPEC §4): a copy no later mutation reaches.

A chunk is data on its way to msgpack: trees of dicts, lists and tuples over strings,
numbers, bytes and arrays. `copy.deepcopy` copies those several times slower than
walking them here (its memo and dispatch per object, on the scheduler thread of every
chunk: docs/performance.md). Immutable leaves are
shared, the containers rebuilt; anything else (an array, a subclass, a user type) is
left to `copy.deepcopy`, and so is a tree too deep to walk (a cycle, say: msgpack will
refuse it later with its own error). Aliasing is not kept, which a tree bound for
msgpack cannot tell.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec

_IMMUTABLE: frozenset[type] = frozenset((str, bytes, int, float, bool, type(None), msgspec.Raw))
"""(`msgspec.Raw`: data encoded already, as a worker saves its outputs' chunks.)"""


def snapshot(obj: Any) -> Any:
    """A copy of `obj` that shares no mutable part with it."""
    try:
        return _copy(obj)
    except RecursionError:
        return copy.deepcopy(obj)


def _copy(obj: Any) -> Any:
    kind = type(obj)
    if kind in _IMMUTABLE:
        return obj
    if kind is list:
        return [x if type(x) in _IMMUTABLE else _copy(x) for x in obj]
    if kind is dict:
        return {
            (k if type(k) in _IMMUTABLE else _copy(k)): (v if type(v) in _IMMUTABLE else _copy(v))
            for k, v in obj.items()
        }
    if kind is tuple:
        return tuple(x if type(x) in _IMMUTABLE else _copy(x) for x in obj)
    return copy.deepcopy(obj)
