"""Each `wire.outgoing` struct is its model's message as a writer builds it: the same fields
in the same order, the same required ones and defaults, the same bytes; and what each
writer encodes is what its model reads (nothing a writer sends is dead-lettered)."""

from __future__ import annotations

from typing import Any

import fakeredis
import msgspec
import msgspec.inspect
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from omni_runtime import keys
from omni_runtime.core.types import OrchOutput
from omni_runtime.errors import CodecError
from omni_runtime.orchestrator.outbox import ClientOutbox
from omni_runtime.orchestrator.stage_client import RedisStageClient
from omni_runtime.redis_io.write_ops import XAdd
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import codec, outgoing
from omni_runtime.wire.messages import OrchOutputMsg, StageInputMsg
from omni_runtime.wire.outgoing import (
    MODEL_OF,
    DurableRequestOut,
    OrchOutputOut,
    StageInputOut,
    StageOutputOut,
)

NAMES = keys.Names("t")
STRUCTS = list(MODEL_OF)

GOOD: dict[Any, dict[str, Any]] = {
    StageInputOut: {"request_id": "r1", "data": "x"},
    StageOutputOut: {"request_id": "r1", "data": ["HI"], "finished": True},
    OrchOutputOut: {"request_id": "r1", "stage_id": 2, "data": "wav", "finished": False, "seq": 3},
    DurableRequestOut: {
        "request_id": "r1",
        "client_id": "c1",
        "prompt": "hi",
        "deadline_at": None,
        "submitted": [0, 1],
        "finished": [0],
    },
}
"""The required fields of each message, valid."""

OPTIONAL: dict[Any, dict[str, Any]] = {
    StageInputOut: {"trace": True, "streaming": True, "owner": 3, "params": {"voice": "a"}},
    StageOutputOut: {
        "error": "boom",
        "seq": 7,
        "error_code": "context_length_exceeded",
        "finish_reason": "length",
        "prompt_tokens": 37,
        "completion_tokens": 5,
        "cached_tokens": 30,
    },
    OrchOutputOut: {
        "error": "boom",
        "error_code": "invalid_value",
        "finish_reason": "stop",
        "prompt_tokens": 0,
        "completion_tokens": 4096,
        "cached_tokens": 0,
    },
    DurableRequestOut: {
        "stage_data": {1: ["a", [1, 2]]},
        "stage_chunks": {1: 2},
        "stage_seq": {0: 2},
        "out_seq": 4,
        "params": {"max_tokens": 8, "stop": ["."]},
    },
}
"""Every field with a default, set to a valid value other than it."""


def model(struct: Any) -> type[BaseModel]:
    return MODEL_OF[struct]


@pytest.mark.parametrize("struct", STRUCTS, ids=lambda s: s.__name__)
def test_each_struct_is_made_from_its_model_field_by_field(struct: Any) -> None:
    """The model's fields in its order, required where it requires them, its defaults."""
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    fields = model(struct).model_fields
    assert [f.name for f in info.fields] == list(fields)
    for field in info.fields:
        expected = fields[field.name]
        assert field.required == expected.is_required(), field.name
        if not field.required:
            default = (
                field.default_factory() if field.default is msgspec.NODEFAULT else field.default
            )
            assert default == expected.get_default(call_default_factory=True), field.name
    assert set(GOOD[struct]) == {n for n, f in fields.items() if f.is_required()}
    assert set(OPTIONAL[struct]) == {n for n, f in fields.items() if not f.is_required()} - {
        "v",
        "type",
    }


@pytest.mark.parametrize("struct", STRUCTS, ids=lambda s: s.__name__)
def test_a_misspelt_or_missing_field_is_refused_where_the_message_is_made(struct: Any) -> None:
    with pytest.raises(TypeError, match="Unexpected keyword argument 'reqest_id'"):
        struct(**GOOD[struct], reqest_id="r1")
    for name in GOOD[struct]:
        with pytest.raises(TypeError, match=f"Missing required argument '{name}'"):
            struct(**{k: v for k, v in GOOD[struct].items() if k != name})


@pytest.mark.parametrize("struct", STRUCTS, ids=lambda s: s.__name__)
@pytest.mark.parametrize("optional", [False, True])
def test_a_struct_encodes_to_its_models_bytes(struct: Any, optional: bool) -> None:
    """The same bytes as the model encoded (field for field, in order), read back as it."""
    fields = {**GOOD[struct], **(OPTIONAL[struct] if optional else {})}
    expected = model(struct)(**fields)
    wire = outgoing.encode(struct(**fields))
    assert wire == codec.encode_model(expected)
    assert codec.decode_model(wire, model(struct)) == expected


data = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False), st.text(max_size=8), st.binary(max_size=4),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(STRUCTS), data, st.booleans())
def test_any_data_a_struct_carries_is_read_back_as_its_model_carries_it(
    struct: Any, value: Any, optional: bool
) -> None:
    free = "prompt" if struct is DurableRequestOut else "data"
    fields = {**GOOD[struct], **(OPTIONAL[struct] if optional else {}), free: value}
    wire = outgoing.encode(struct(**fields))
    assert wire == codec.encode_model(model(struct)(**fields))
    assert codec.decode_model(wire, model(struct)) == model(struct)(**fields)


@pytest.mark.parametrize("struct", [StageInputOut, StageOutputOut], ids=lambda s: s.__name__)
def test_data_from_stage_code_is_held_to_msgpacks_rules(struct: Any) -> None:
    """msgspec would write a set as an array, a dataclass as a map: the wire refuses them."""
    with pytest.raises(CodecError, match=r"cannot encode object of type builtins\.set"):
        outgoing.encode(struct(**{**GOOD[struct], "data": {1, 2}}))
    raw = codec.encode_raw(["a", 1])  # encoded already: written as it is
    wire = outgoing.encode(struct(**{**GOOD[struct], "data": raw}))
    assert wire == outgoing.encode(struct(**{**GOOD[struct], "data": ["a", 1]}))


def nested(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("struct", STRUCTS, ids=lambda s: s.__name__)
def test_a_field_nested_deeper_than_a_message_may_carry_is_refused(struct: Any) -> None:
    """A message's map is level 1 of `codec.MAX_DEPTH`: its fields may nest one less."""
    free = "prompt" if struct is DurableRequestOut else "data"
    fits = struct(**{**GOOD[struct], free: nested(codec.MAX_DEPTH - 1)})
    assert codec.decode(outgoing.encode(fits))[free] == nested(codec.MAX_DEPTH - 1)
    too_deep = struct(**{**GOOD[struct], free: nested(codec.MAX_DEPTH)})
    with pytest.raises(CodecError, match="nested deeper than 64"):
        outgoing.encode(too_deep)


def written(writer: StreamWriter) -> list[bytes]:
    return [op.fields[keys.PAYLOAD_FIELD] for op in writer._ops if isinstance(op, XAdd)]


async def test_the_stage_inputs_a_stage_client_writes_are_their_models() -> None:
    writer = StreamWriter(fakeredis.FakeAsyncRedis(), 100)
    stage = RedisStageClient(
        fakeredis.FakeAsyncRedis(), writer, 1, NAMES, read_count=1, block_ms=1,
        max_message_bytes=1 << 20, streaming=True, slot=3,
    )  # fmt: skip
    pcm = np.arange(4, dtype=np.float32)
    await stage.submit("r1", {"pcm": pcm}, {"voice": "a"})
    await stage.submit("r2", "x", {})
    with pytest.raises(CodecError):
        await stage.submit("r3", {1, 2})
    first, second = (codec.decode_model(w, StageInputMsg) for w in written(writer))
    np.testing.assert_array_equal(first.data["pcm"], pcm)
    assert (first.owner, first.streaming, first.params) == (3, True, {"voice": "a"})
    assert second == StageInputMsg(request_id="r2", data="x", streaming=True, owner=3)


def test_the_outputs_an_outbox_writes_are_their_models() -> None:
    writer = StreamWriter(fakeredis.FakeAsyncRedis(), 100)
    box = ClientOutbox(writer, NAMES, 60, 1 << 20)
    box.client_of["a"] = "c1"
    relayed = msgspec.Raw(codec.encode(np.arange(3, dtype=np.int16)))  # a stage's, as read
    box.send(OrchOutput("a", 1, relayed, False))
    box.send(OrchOutput("a", 2, None, True, error="e" * 10_000))
    box.refuse("z", "c1", "no live worker for stage 1")
    msgs = [codec.decode_model(w, OrchOutputMsg) for w in written(writer)]
    assert [(m.request_id, m.seq, m.finished) for m in msgs] == [
        ("a", 0, False),
        ("a", 1, True),
        ("z", 0, True),
    ]
    np.testing.assert_array_equal(msgs[0].data, np.arange(3, dtype=np.int16))
    assert msgs[1].error is not None and msgs[1].error.endswith("…")
