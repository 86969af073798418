"""Read-side mirrors of the wire messages read most often, decoded and checked in one pass.

Every request reaches the orchestrator, its stage outputs too, its outputs its client,
one message per chunk, and each stage's worker reads its input. msgspec decodes the bytes
straight into these structs, with the same checks, faster than msgpack then pydantic
(docs/performance.md).

A mirror accepts exactly what its model accepts (the models are strict: nothing is
coerced), with the same bounds (`messages`); whatever a mirror refuses, `redis_io.entries`
hands to the model, which says why. So a reader given a view accepts exactly the
messages, values and errors its model would. `tests/unit/test_wire_views.py` and
`tests/unit/test_wire_schema.py` (property tests, hostile values) hold each mirror to its
model.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from pydantic import BaseModel, TypeAdapter

from omni_runtime.errors import CodecError
from omni_runtime.wire import codec
from omni_runtime.wire import messages as m
from omni_runtime.wire.messages import (
    WIRE_VERSION,
    AbortMsg,
    ClientCommand,
    OrchOutputMsg,
    RequestMsg,
    StageInputMsg,
    StageOutputMsg,
)

RequestId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=256, pattern=r"\A[^\x00-\x1f\x7f]+\Z")
]
ClientId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=128, pattern=r"\A[A-Za-z0-9_.-]+\Z")
]
"""`messages.ClientId`, anchored at the very end: Python's `$` also matches before a final
newline, pydantic's does not."""
Seq = Annotated[int, msgspec.Meta(ge=0, le=m.MAX_SEQ)]
StageId = Annotated[int, msgspec.Meta(ge=0, lt=m.MAX_STAGES)]
Slot = Annotated[int, msgspec.Meta(ge=0, lt=m.MAX_SLOTS)]
DeadlineS = Annotated[float, msgspec.Meta(gt=0, le=m.MAX_DEADLINE_S)]
"""A bound refuses `nan` and `inf` as well (msgspec has no `allow_inf_nan`)."""
Reason = Annotated[str, msgspec.Meta(min_length=1, max_length=m.MAX_REASON_CHARS)]
Error = Annotated[str, msgspec.Meta(min_length=1, max_length=m.MAX_ERROR_CHARS)]
ParamScalar = (
    None
    | bool
    | Annotated[int, msgspec.Meta(ge=m.INT_MIN, le=m.INT_MAX)]
    | Annotated[float, msgspec.Meta(ge=-m.FLOAT_MAX, le=m.FLOAT_MAX)]
    | Annotated[str, msgspec.Meta(max_length=m.MAX_PARAM_STR_CHARS)]
)
Params = Annotated[
    dict[
        Annotated[str, msgspec.Meta(min_length=1, max_length=m.MAX_PARAM_KEY_CHARS)],
        ParamScalar | Annotated[list[ParamScalar], msgspec.Meta(max_length=m.MAX_PARAM_LIST)],
    ],
    msgspec.Meta(max_length=m.MAX_PARAMS),
]


class _View(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    v: Literal[1] = WIRE_VERSION


class RequestView(
    _View, tag_field="type", tag="request", frozen=True, forbid_unknown_fields=True, kw_only=True
):
    """`messages.RequestMsg`, as the orchestrator reads it off the requests stream."""

    request_id: RequestId
    client_id: ClientId
    prompt: Any
    deadline_s: DeadlineS | None = None
    trace: bool = False
    params: Params | None = None


class AbortView(
    _View, tag_field="type", tag="abort", frozen=True, forbid_unknown_fields=True, kw_only=True
):
    """`messages.AbortMsg`, as the orchestrator reads it off the requests stream."""

    request_id: RequestId
    reason: Reason = "aborted"


ClientCommandView = RequestView | AbortView
"""What may appear on the requests stream (`messages.ClientCommand`), tagged by `type`."""


class StageInputView(_View, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`messages.StageInputMsg`, as a stage's worker reads it."""

    type: Literal["stage_input"]
    request_id: RequestId
    trace: bool = False
    data: Any
    streaming: bool = False
    owner: Slot = 0
    params: Params | None = None


class StageOutputView(_View, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`messages.StageOutputMsg`, as the orchestrator reads it."""

    type: Literal["stage_output"]
    request_id: RequestId
    data: Any
    finished: bool
    error: Error | None = None
    seq: Seq = 0


class StageOutputRelayView(StageOutputView, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`StageOutputView` with its data kept as read (`msgspec.Raw`), checked by
    `codec.check`: a streaming orchestrator only relays a stage's data to the client (and
    holds it), so decoding an array only to encode it again was a fifth of its CPU. (On
    the slow path, a message its model had to accept, `data` is the decoded value.)"""

    data: msgspec.Raw


class OrchOutputView(_View, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`messages.OrchOutputMsg`, as a client reads it."""

    type: Literal["orch_output"]
    request_id: RequestId
    stage_id: StageId
    data: Any
    finished: bool
    error: Error | None = None
    seq: Seq


MODEL_OF: Final[dict[Any, type[BaseModel] | TypeAdapter[Any]]] = {
    ClientCommandView: TypeAdapter(ClientCommand),
    StageInputView: StageInputMsg,
    StageOutputView: StageOutputMsg,
    StageOutputRelayView: StageOutputMsg,
    OrchOutputView: OrchOutputMsg,
}
"""Each view's model: the authority on whatever the view refuses."""


_FREE_FORM: Final[dict[type, str]] = {
    RequestView: "prompt",
    StageInputView: "data",
    StageOutputView: "data",
    OrchOutputView: "data",
}
"""Each view's one field of any shape (`Any`), whose depth the decoder did not bound."""


def is_view(model: object) -> bool:
    return model in MODEL_OF


_DECODERS: dict[tuple[Any, bool], msgspec.msgpack.Decoder[Any]] = {}


def _decoder(view: Any, batches: bool) -> msgspec.msgpack.Decoder[Any]:
    decoder = _DECODERS.get((view, batches))
    if decoder is None:
        decoder = codec.typed_decoder(view | list[view] if batches else view)
        _DECODERS[(view, batches)] = decoder
    return decoder


_PAYLOAD_DEPTH: Final = codec.MAX_DEPTH - 1
"""How deep a message's free-form field (`prompt`, `data`) may nest: one level below the
message's map, as `codec.decode` counts it."""


def decode_views(raw: bytes, view: Any, batches: bool) -> list[Any] | None:
    """The message (or, with `batches`, the batch) in `raw` as views; None when the view
    refuses it (the caller asks the model for the reason)."""
    try:
        got = _decoder(view, batches).decode(raw)
        msgs = got if isinstance(got, list) else [got]
        for msg in msgs:
            if type(msg) is StageOutputRelayView:
                codec.check(msg.data, _PAYLOAD_DEPTH)
                continue
            free = _FREE_FORM.get(type(msg))
            if free is not None and not codec.within(getattr(msg, free), _PAYLOAD_DEPTH):
                return None
    except (msgspec.MsgspecError, CodecError, RecursionError):  # deep: `decode` says why
        return None
    return msgs


_MEMBER_OF: Final[dict[type[BaseModel], type[_View]]] = {
    RequestMsg: RequestView,
    AbortMsg: AbortView,
}
"""A union view's member for each model its model may give."""


def view_of(msg: BaseModel, view: Any) -> Any:
    """A message its model accepted, as `view` (the slow path's result, same shape)."""
    one: type[_View] = view if isinstance(view, type) else _MEMBER_OF[type(msg)]
    return one(**{name: getattr(msg, name) for name in one.__struct_fields__})
