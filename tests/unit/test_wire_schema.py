"""Property tests of the wire schema with hostile values (`tests/hostile.py`): every field
of every message bounded; each msgspec view accepts exactly what its model accepts (the
bytes a hostile writer could send, inf, nan, huge, negative, empty, wrong-typed, too long,
too deep); and nothing accepted can raise later in what the orchestrator computes and
writes from it (deadline → PEXPIREAT ms, its stage inputs, its durable state, its errors)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, ValidationError

from omni_runtime.core.types import request_finals
from omni_runtime.errors import CodecError
from omni_runtime.orchestrator import intake
from omni_runtime.orchestrator.request_store import expiry_ms
from omni_runtime.settings import Settings
from omni_runtime.wire import codec, messages
from omni_runtime.wire.messages import (
    AbortMsg,
    ClientCommand,
    DurableRequest,
    OrchOutputMsg,
    RequestMsg,
    StageInputMsg,
    StageOutputMsg,
)
from omni_runtime.wire.views import (
    ClientCommandView,
    OrchOutputView,
    RequestView,
    StageInputView,
    StageOutputRelayView,
    StageOutputView,
    decode_views,
)
from tests.hostile import KINDS, Deep, any_docs, hostile_docs, raw, valid_docs

FINALS = frozenset({0, 2})
PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODEL: dict[str, type[BaseModel]] = {
    "request": RequestMsg,
    "abort": AbortMsg,
    "stage_input": StageInputMsg,
    "stage_output": StageOutputMsg,
    "orch_output": OrchOutputMsg,
    "request_state": DurableRequest,
}
VIEWS: dict[str, list[Any]] = {
    "request": [ClientCommandView],
    "abort": [ClientCommandView],
    "stage_input": [StageInputView],
    "stage_output": [StageOutputView, StageOutputRelayView],
    "orch_output": [OrchOutputView],
    "request_state": [],  # read by its model only (`RequestStore.load`)
}
COMMAND: TypeAdapter[RequestMsg | AbortMsg] = TypeAdapter(ClientCommand)
INT64_MAX = 2**63 - 1


def by_model(data: bytes, kind: str) -> BaseModel | None:
    """What the model path reads (`codec.decode`, then validation), None if it refuses."""
    try:
        obj = codec.decode(data)
        if kind in ("request", "abort"):
            return COMMAND.validate_python(obj)
        return MODEL[kind].model_validate(obj)
    except (CodecError, ValidationError):
        return None


def fields_of(msg: Any) -> dict[str, Any]:
    """A message's fields, comparable between a view and a model (relayed data decoded)."""
    if isinstance(msg, BaseModel):
        names = set(type(msg).model_fields)
    else:
        names = set(msg.__struct_fields__)
    out = {}
    for name in sorted(names - {"type"}):
        value = getattr(msg, name)
        if isinstance(value, msgspec.Raw):
            value = codec.decode(bytes(memoryview(value)))
        out[name] = value
    return out


def same(a: Any, b: Any) -> bool:
    return repr(fields_of(a)) == repr(fields_of(b))  # repr: a NaN equals a NaN


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY
@given(data=st.data())
def test_a_hostile_message_is_refused_by_its_model_and_its_views(
    kind: str, data: st.DataObject
) -> None:
    doc = data.draw(hostile_docs(kind))
    wire = raw(doc)
    assert by_model(wire, kind) is None, doc
    for view in VIEWS[kind]:
        assert decode_views(wire, view, False) is None, doc


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY
@given(data=st.data())
def test_a_valid_message_is_read_alike_by_its_model_and_its_views(
    kind: str, data: st.DataObject
) -> None:
    doc = data.draw(valid_docs(kind))
    wire = raw(doc)
    msg = by_model(wire, kind)
    assert msg is not None, doc
    for view in VIEWS[kind]:
        got = decode_views(wire, view, False)
        assert got is not None, doc
        assert same(got[0], msg)


@pytest.mark.parametrize("kind", [k for k in KINDS if VIEWS[k]])
@PROPERTY
@given(data=st.data(), batches=st.booleans())
def test_any_message_is_accepted_by_the_view_exactly_when_by_the_model(
    kind: str, data: st.DataObject, batches: bool
) -> None:
    """Both accept (the same fields) or both refuse: whatever the values."""
    doc = data.draw(any_docs(kind))
    wire = raw([doc, doc] if batches else doc)
    msg = by_model(raw(doc), kind)
    for view in VIEWS[kind]:
        got = decode_views(wire, view, batches)
        assert (got is not None) == (msg is not None), (view, doc)
        if got is not None and msg is not None:
            assert all(same(one, msg) for one in got)


def test_nesting_too_deep_for_any_recursion_is_one_codec_error_everywhere() -> None:
    """A prompt 1,000 (or 100,000) lists deep: refused as malformed, never a bare
    RecursionError in a reader."""
    for depth in (codec.MAX_DEPTH, 1000, 100_000):
        doc = {"type": "request", "request_id": "r", "client_id": "c", "prompt": Deep(depth)}
        wire = raw(doc)
        assert decode_views(wire, ClientCommandView, False) is None
        with pytest.raises(CodecError, match="nested deeper than"):
            codec.decode(wire)
    ok = {"type": "request", "request_id": "r", "client_id": "c", "prompt": Deep(62)}
    assert decode_views(raw(ok), ClientCommandView, False) is not None


@PROPERTY
@given(doc=any_docs("request"), now=st.floats(1.7e9, 4.1e9))
def test_nothing_accepted_in_a_request_can_raise_later(doc: dict[str, Any], now: float) -> None:
    """What the orchestrator computes and writes from an accepted request: its deadline's
    expiry (PEXPIREAT ms within Redis's int64), the deployment's refusal, the stage input
    and the durable state it writes (accepted by their readers), an error final."""
    got = decode_views(raw(doc), ClientCommandView, False)
    if got is None or not isinstance(got[0], RequestView):
        return
    cmd = got[0]
    for limits in (Settings(), Settings(deadline_s=60, max_deadline_s=messages.MAX_DEADLINE_S)):
        refused = intake.refusal(cmd, limits.max_deadline_s, FINALS)
        deadline_at = now + (cmd.deadline_s or limits.deadline_s)
        assert 0 < expiry_ms(deadline_at) <= INT64_MAX
        if refused is not None:
            assert refused[0] in (intake.DEADLINE_TOO_LONG, intake.INVALID_REQUEST)
            assert_error_final_is_readable(refused[1])
    assert request_finals(FINALS, 2, cmd.params) <= FINALS  # never raises, never empty
    assert request_finals(FINALS, 2, cmd.params)
    stage_input = {"type": "stage_input", "request_id": cmd.request_id, "data": cmd.prompt}
    if cmd.params:
        stage_input["params"] = cmd.params
    (back,) = decode_views(codec.encode(stage_input), StageInputView, False) or [None]
    assert back is not None and back.params == (cmd.params or None)
    state = {
        "v": 1,
        "type": "request_state",
        "request_id": cmd.request_id,
        "client_id": cmd.client_id,
        "prompt": cmd.prompt,
        "params": cmd.params,
        "deadline_at": now + (cmd.deadline_s or 600.0),
        "submitted": [0],
        "finished": [],
        "stage_data": {},
        "stage_seq": {0: 3},
        "out_seq": 2,
    }
    loaded = codec.decode_model(codec.encode_decoded(state), DurableRequest)
    assert loaded.deadline_at is not None and expiry_ms(loaded.deadline_at) <= INT64_MAX


@PROPERTY
@given(doc=any_docs("request_state"))
def test_a_durable_state_accepted_has_an_expiry_redis_takes(doc: dict[str, Any]) -> None:
    msg = by_model(raw(doc), "request_state")
    if isinstance(msg, DurableRequest) and msg.deadline_at is not None:
        assert 0 < expiry_ms(msg.deadline_at) <= INT64_MAX


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, 1e300, 2.0**63])
def test_an_expiry_out_of_range_is_a_value_error_not_a_wrong_command(value: float) -> None:
    with pytest.raises(ValueError, match="out of range"):
        expiry_ms(value)


@given(error=st.text(max_size=20_000))
def test_every_error_final_fits_its_message(error: str) -> None:
    assert_error_final_is_readable(intake.invalid(error or "x"))
    assert_error_final_is_readable(messages.clip_error(error or "x"))


def assert_error_final_is_readable(error: str) -> None:
    final = {"type": "orch_output", "request_id": "r", "stage_id": 0, "data": None}
    doc = {**final, "finished": True, "error": error, "seq": 0}
    assert decode_views(codec.encode(doc), OrchOutputView, False) is not None, error[:80]


def test_the_client_refuses_what_a_reader_would_refuse_at_submit() -> None:
    with pytest.raises(CodecError, match="invalid request: deadline_s"):
        messages.checked_request(request_id="r", client_id="c", prompt=1, deadline_s=1e308)
    with pytest.raises(CodecError, match="invalid request: params"):
        messages.checked_request(request_id="r", client_id="c", prompt=1, params={"a": {}})
    ok = messages.checked_request(request_id="r", client_id="c", prompt=1, deadline_s=3)
    assert ok.deadline_s == 3.0


def test_limits_are_consistent_across_modules() -> None:
    from omni_runtime.orchestrator.leases import MAX_SLOTS
    from omni_runtime.pipeline import PipelineConfig

    assert MAX_SLOTS == messages.MAX_SLOTS
    stages = PipelineConfig.model_fields["stages"].metadata
    assert any(getattr(meta, "max_length", None) == messages.MAX_STAGES for meta in stages)
    assert Settings().deadline_s <= Settings().max_deadline_s <= messages.MAX_DEADLINE_S
    assert (time.time() + messages.MAX_DEADLINE_S) < messages.MAX_WALL_CLOCK_S
