"""Each `wire_views` mirror reads exactly what its pydantic model reads: same fields and
defaults, same accepted values, same error for what it refuses (the one-pass decode
must never let through what the model would refuse, nor refuse what it would take)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from omni_runtime import codec, keys
from omni_runtime.errors import CodecError
from omni_runtime.redis_io.entries import parse_entries, parse_entry
from omni_runtime.wire_views import (
    MODEL_OF,
    OrchOutputView,
    StageInputView,
    StageOutputView,
    decode_views,
)

FIELD = keys.PAYLOAD_FIELD.encode()
VIEWS = list(MODEL_OF)

GOOD: dict[type[Any], dict[str, Any]] = {
    StageInputView: {"type": "stage_input", "request_id": "r1", "data": "x", "owner": 1},
    StageOutputView: {"type": "stage_output", "request_id": "r1", "data": ["HI"], "finished": True},
    OrchOutputView: {
        "type": "orch_output",
        "request_id": "r1",
        "stage_id": 2,
        "data": "wav:HI",
        "finished": False,
        "seq": 3,
    },
}

ODD_VALUES = [
    None, True, False, 0, 1, -1, 2**63, 1.0, 0.5, "", "x", "r" * 257, "true", b"r1",
    [], ["a"], {}, {"k": 1}, "stage_output", "orch_output", "stage_input",
]  # fmt: skip


def read(view: type[Any], doc: Any, batches: bool) -> tuple[str, Any]:
    """("ok", fields of each message) or ("error", the CodecError's text), view vs model."""
    fields = {FIELD: codec.encode(doc)}
    got: list[Any]
    try:
        if batches:
            got = parse_entries(fields, view, 1 << 20)
        else:
            got = [parse_entry(fields, view, 1 << 20)]
    except CodecError as e:
        return "error", str(e)
    return "ok", [{n: getattr(m, n) for n in view.__struct_fields__} for m in got]


def read_model(model: type[BaseModel], view: type[Any], doc: Any, batches: bool) -> tuple[str, Any]:
    fields = {FIELD: codec.encode(doc)}
    try:
        got = (
            parse_entries(fields, model, 1 << 20)
            if batches
            else [parse_entry(fields, model, 1 << 20)]
        )
    except CodecError as e:
        return "error", str(e)
    return "ok", [{n: getattr(m, n) for n in view.__struct_fields__} for m in got]


@pytest.mark.parametrize("view", VIEWS, ids=lambda v: v.__name__)
def test_fields_and_defaults_are_the_models(view: type[Any]) -> None:
    model = MODEL_OF[view]
    assert set(view.__struct_fields__) == set(model.model_fields)
    blank = view(**GOOD[view])
    for name, info in model.model_fields.items():
        if not info.is_required() and name not in GOOD[view]:
            assert getattr(blank, name) == info.default, name


@pytest.mark.parametrize("view", VIEWS, ids=lambda v: v.__name__)
@pytest.mark.parametrize("batches", [False, True])
def test_every_field_taking_odd_values_reads_as_the_model_reads_it(
    view: type[Any], batches: bool
) -> None:
    model = MODEL_OF[view]
    docs: list[Any] = [GOOD[view], [GOOD[view], GOOD[view]], [], "not a map", {"type": None}]
    for name in view.__struct_fields__:
        docs += [{**GOOD[view], name: value} for value in ODD_VALUES]
        docs.append({k: v for k, v in GOOD[view].items() if k != name})
    docs.append({**GOOD[view], "extra": 1})
    for doc in docs:
        assert read(view, doc, batches) == read_model(model, view, doc, batches), doc


def test_a_lax_value_the_model_coerces_takes_the_models_path() -> None:
    doc = {**GOOD[StageOutputView], "finished": 1}
    assert decode_views(codec.encode(doc), StageOutputView, False) is None
    (out,) = parse_entries({FIELD: codec.encode(doc)}, StageOutputView, 1 << 20)
    assert isinstance(out, StageOutputView)
    assert out.finished is True


def test_arrays_in_data_arrive_as_the_codec_gives_them() -> None:
    pcm = np.arange(8, dtype=np.float32)
    doc = {**GOOD[OrchOutputView], "data": {"pcm": pcm, "sr": 24000}}
    assert decode_views(codec.encode(doc), OrchOutputView, False) is not None
    (out,) = parse_entries({FIELD: codec.encode(doc)}, OrchOutputView, 1 << 20)
    np.testing.assert_array_equal(out.data["pcm"], pcm)
    assert not out.data["pcm"].flags.writeable


def test_an_entry_over_the_size_limit_is_refused_as_the_model_refuses_it() -> None:
    doc = {**GOOD[StageOutputView], "data": "x" * 500}
    with pytest.raises(CodecError, match="exceeds the limit"):
        parse_entries({FIELD: codec.encode(doc)}, StageOutputView, 100)


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
    st.text(max_size=8), st.binary(max_size=4),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(VIEWS),
    st.dictionaries(
        st.sampled_from(["v", "type", "request_id", "stage_id", "data", "finished", "error",
                         "seq", "trace", "streaming", "owner", "other"]),
        st.one_of(scalars, st.lists(scalars, max_size=2)),
        max_size=8,
    ),
    st.booleans(),
)  # fmt: skip
def test_any_map_reads_as_the_model_reads_it(
    view: type[Any], doc: dict[str, Any], batches: bool
) -> None:
    for candidate in ({**GOOD[view], **doc}, doc):
        assert read(view, candidate, batches) == read_model(
            MODEL_OF[view], view, candidate, batches
        )
