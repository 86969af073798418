"""The default `save_async` snapshot: equal to its input, sharing no mutable part with it."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from omni_runtime.chunks.snapshot import snapshot

leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(), st.binary()
)
trees = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=4)
    ),
    max_leaves=30,
)


def mutable_parts(obj: Any) -> list[Any]:
    """Every list and dict inside `obj`, itself included."""
    found = [obj] if isinstance(obj, list | dict) else []
    children = (
        obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else []
    )
    for child in children:
        found += mutable_parts(child)
    return found


@given(trees)
def test_a_snapshot_equals_its_input_and_shares_no_list_or_dict(tree: Any) -> None:
    snap = snapshot(tree)
    assert snap == tree == copy.deepcopy(tree)
    theirs = {id(x) for x in mutable_parts(tree)}
    assert not theirs & {id(x) for x in mutable_parts(snap)}


def test_mutating_the_live_object_later_changes_nothing_in_the_snapshot() -> None:
    live: dict[str, Any] = {"token": "hi", "codes": [1, 2], "nested": ({"k": [3]},)}
    snap = snapshot(live)
    live["codes"].append(9)
    live["nested"][0]["k"].append(4)
    live["token"] = "changed"
    assert snap == {"token": "hi", "codes": [1, 2], "nested": ({"k": [3]},)}


def test_arrays_and_other_types_are_deep_copied() -> None:
    arr = np.arange(4, dtype=np.float32)
    snap = snapshot({"pcm": arr, "set": {1, 2}})
    arr[0] = 42.0
    assert snap["pcm"][0] == 0.0 and snap["pcm"] is not arr
    assert snap["set"] == {1, 2}


def test_a_cycle_falls_back_to_deepcopy() -> None:
    cyclic: list[Any] = [1]
    cyclic.append(cyclic)
    snap = snapshot(cyclic)
    assert snap[0] == 1 and snap[1] is snap and snap is not cyclic
