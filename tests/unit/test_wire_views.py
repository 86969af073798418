"""Each `wire.views` mirror reads exactly what its pydantic model reads: same fields and
defaults, same accepted values, same error for what it refuses (the one-pass decode
must never let through what the model would refuse, nor refuse what it would take)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, get_args, get_origin

import msgspec
import msgspec.inspect
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from omni_runtime import keys
from omni_runtime.errors import CodecError
from omni_runtime.redis_io.entries import parse_entries, parse_entry
from omni_runtime.wire import codec
from omni_runtime.wire.messages import AbortMsg, RequestMsg
from omni_runtime.wire.views import (
    MODEL_OF,
    AbortView,
    ClientCommandView,
    OrchOutputView,
    RequestView,
    StageInputView,
    StageOutputRelayView,
    StageOutputView,
    decode_views,
)

FIELD = keys.PAYLOAD_FIELD.encode()
VIEWS = [view for view in MODEL_OF if isinstance(view, type)]
"""The views of one message type (the requests stream's union is tested on its own)."""

GOOD: dict[Any, dict[str, Any]] = {
    RequestView: {"type": "request", "request_id": "r1", "client_id": "c1", "prompt": "hi"},
    AbortView: {"type": "abort", "request_id": "r1", "reason": "gone"},
    StageInputView: {"type": "stage_input", "request_id": "r1", "data": "x", "owner": 1},
    StageOutputView: {"type": "stage_output", "request_id": "r1", "data": ["HI"], "finished": True},
    StageOutputRelayView: {
        "type": "stage_output",
        "request_id": "r1",
        "data": ["HI"],
        "finished": True,
    },
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
    [], ["a"], {}, {"k": 1}, "stage_output", "orch_output", "stage_input", "request", "abort",
    "c1\n", "a b", float("nan"), float("inf"), -0.5, 5,
]  # fmt: skip


def as_doc(msg: Any) -> tuple[str, dict[str, Any]]:
    """A message read by a view or by its model, comparable: its kind and its fields."""
    if isinstance(msg, BaseModel):
        kind, names = type(msg).__name__.removesuffix("Msg"), set(type(msg).model_fields)
    else:  # a relay view's data is the bytes as read: compared as what they decode to
        kind = type(msg).__name__.removesuffix("View").removesuffix("Relay")
        names = set(msg.__struct_fields__)
    return kind, {n: as_read(getattr(msg, n)) for n in sorted(names - {"type"})}


def as_read(value: Any) -> Any:
    return codec.decode(bytes(memoryview(value))) if isinstance(value, msgspec.Raw) else value


def read(model: Any, doc: Any, batches: bool) -> str:
    """repr of ("ok", each message as `as_doc`) or ("error", the CodecError's text): a repr,
    so that a NaN read is equal to a NaN read."""
    fields = {FIELD: codec.encode(doc)}
    got: list[Any]
    try:
        if batches:
            got = parse_entries(fields, model, 1 << 20)
        else:
            got = [parse_entry(fields, model, 1 << 20)]
    except CodecError as e:
        return repr(("error", str(e)))
    return repr(("ok", [as_doc(m) for m in got]))


@pytest.mark.parametrize("view", VIEWS, ids=lambda v: v.__name__)
def test_fields_and_defaults_are_the_models(view: type[Any]) -> None:
    model = MODEL_OF[view]
    assert isinstance(model, type)
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
        assert read(view, doc, batches) == read(model, doc, batches), doc


@pytest.mark.parametrize("kind", [RequestView, AbortView], ids=lambda v: v.__name__)
def test_the_requests_streams_commands_read_as_their_union_model_reads_them(kind: Any) -> None:
    model = MODEL_OF[ClientCommandView]
    other = "abort" if kind is RequestView else "request"
    docs: list[Any] = [GOOD[kind], [GOOD[kind]], "not a map", {"type": None}, {"type": "x"}]
    for name in (*kind.__struct_fields__, "type"):
        docs += [{**GOOD[kind], name: value} for value in ODD_VALUES]
        docs.append({k: v for k, v in GOOD[kind].items() if k != name})
    docs += [{**GOOD[kind], "extra": 1}, {**GOOD[kind], "type": other}]
    for doc in docs:
        assert read(ClientCommandView, doc, False) == read(model, doc, False), doc
    assert read(ClientCommandView, GOOD[kind], False).startswith("('ok'")


def test_a_lax_value_is_refused_by_view_and_model_alike() -> None:
    """Strict: `finished=1` is not True, "5" is not 5 (nothing is coerced into another value)."""
    for doc in (
        {**GOOD[StageOutputView], "finished": 1},
        {**GOOD[StageOutputView], "seq": "5"},
        {**GOOD[StageOutputView], "v": True},
    ):
        assert decode_views(codec.encode(doc), StageOutputView, False) is None
        with pytest.raises(CodecError, match="invalid stage_output message"):
            parse_entries({FIELD: codec.encode(doc)}, StageOutputView, 1 << 20)


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
        assert read(view, candidate, batches) == read(MODEL_OF[view], candidate, batches)


def test_a_relay_view_keeps_the_data_as_read_and_checks_it() -> None:
    """Relayed data is the very bytes the stage wrote (an array too), encoded back as is;
    a bad array is refused as the model refuses it."""
    pcm = np.arange(5, dtype=np.float32)
    doc = {"type": "stage_output", "request_id": "r1", "data": pcm, "finished": False}
    (msg,) = parse_entries({FIELD: codec.encode(doc)}, StageOutputRelayView, 1 << 20)
    assert isinstance(msg.data, msgspec.Raw)
    assert bytes(memoryview(msg.data)) == codec.encode(pcm)
    assert codec.is_array(msg.data) and not codec.is_array(codec.encode("tok"))
    assert codec.encode_decoded({"data": msg.data}) == codec.encode({"data": pcm})
    wire = codec.encode(doc)
    bad = wire.replace(b"<f4", b"<f3")  # a dtype numpy does not know, same length
    errors = []
    for view in (StageOutputRelayView, StageOutputView):
        with pytest.raises(CodecError) as e:
            parse_entries({FIELD: bad}, view, 1 << 20)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "dtype" in errors[0]


@pytest.mark.parametrize("view", [StageOutputView, StageOutputRelayView, OrchOutputView])
@pytest.mark.parametrize("payload", [b"\x01", b"\x07\x00\x92\xa3<f3\x91\x01" + bytes(23)])
def test_a_bad_array_is_a_codec_error_for_every_view(view: Any, payload: bytes) -> None:
    """Truncated, or well spelled but unknown to numpy: never another exception, which
    would stop a reader instead of dead-lettering one entry."""
    doc = {**GOOD[view], "data": msgpack_ext(payload)}
    with pytest.raises(CodecError):
        parse_entries({FIELD: codec.encode(doc)}, view, 1 << 20)


def msgpack_ext(payload: bytes) -> Any:
    import msgpack

    return msgpack.ExtType(codec.NDARRAY_EXT_CODE, payload)


BOUNDS = ("gt", "ge", "lt", "le", "min_length", "max_length")


def _model_bounds(annotation: Any, metadata: Sequence[Any] = ()) -> list[tuple[str, Any]]:
    """Every bound a pydantic annotation carries, however deep (lists, maps, unions)."""
    found: list[tuple[str, Any]] = []
    for item in metadata:
        found += [(b, getattr(item, b)) for b in BOUNDS if getattr(item, b, None) is not None]
        if isinstance(item, FieldInfo):
            found += _model_bounds(None, item.metadata)
        elif getattr(item, "pattern", None) is not None:
            found.append(("pattern", item.pattern))
    if get_origin(annotation) is Annotated:
        inner, *meta = get_args(annotation)
        return found + _model_bounds(inner, meta)
    for arg in get_args(annotation):
        found += _model_bounds(arg)
    return found


def _view_bounds(info: Any) -> list[tuple[str, Any]]:
    """Every bound msgspec checks on a field of a view, however deep."""
    found = [(b, getattr(info, b)) for b in BOUNDS if getattr(info, b, None) is not None]
    if getattr(info, "pattern", None) is not None:  # anchored for Python's re: `\A … \Z`
        found.append(("pattern", "^" + info.pattern.removeprefix("\\A").removesuffix("\\Z") + "$"))
    for inner in ("types", "item_type", "key_type", "value_type"):
        value = getattr(info, inner, None)
        for sub in value if isinstance(value, tuple) else [value] if value is not None else []:
            found += _view_bounds(sub)
    return found


@pytest.mark.parametrize("view", [*VIEWS, RequestView, AbortView])
def test_each_view_is_made_from_its_model_field_by_field(view: Any) -> None:
    """The views are generated from the models (one definition): same fields, the same
    required ones and defaults, and every bound at every depth, nothing else."""
    models = {v: m for v, m in MODEL_OF.items() if isinstance(v, type)}
    model = {**models, RequestView: RequestMsg, AbortView: AbortMsg}[view]
    assert isinstance(model, type) and issubclass(model, BaseModel)
    struct = msgspec.inspect.type_info(view)
    assert isinstance(struct, msgspec.inspect.StructType)
    fields = {f.name: f for f in struct.fields}
    expected = set(model.model_fields) - ({"type"} if view in (RequestView, AbortView) else set())
    assert set(fields) == expected
    for name, field in fields.items():
        info = model.model_fields[name]
        assert field.required == (info.is_required() or name == "type"), name
        if not field.required:
            assert field.default == info.get_default(call_default_factory=True), name
        if view is StageOutputRelayView and name == "data":
            continue  # kept as read (msgspec.Raw), checked by `codec.check`
        model_bounds = _model_bounds(info.annotation, info.metadata)
        assert sorted(map(repr, _view_bounds(field.type))) == sorted(map(repr, model_bounds)), name
