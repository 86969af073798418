"""Read-side mirrors of the wire messages read most often, decoded and checked in one pass.

Every request reaches the orchestrator, its stage outputs too, its outputs its client,
one message per chunk, and each stage's worker reads its input. Parsing each into its pydantic model
(msgpack, then validation) cost ~11 µs of CPU on a 2-core VM; msgspec decodes the same
bytes straight into these structs, with the same checks, in ~1 µs.

A mirror accepts a subset of what its model accepts: it refuses what the model would
coerce (`finished=1`, taken as True). Whatever a mirror refuses, `redis_io.entries`
hands to the model, which accepts it (coerced) or says why. So a reader given a view
accepts exactly the messages, values and errors its model would.
`tests/unit/test_wire_views.py` holds each mirror to its model.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from pydantic import BaseModel, TypeAdapter

from omni_runtime import codec
from omni_runtime.errors import CodecError
from omni_runtime.messages import (
    WIRE_VERSION,
    AbortMsg,
    ClientCommand,
    OrchOutputMsg,
    RequestMsg,
    StageInputMsg,
    StageOutputMsg,
)

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Seq = Annotated[int, msgspec.Meta(ge=0)]
ClientId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=128, pattern=r"\A[A-Za-z0-9_.-]+\Z")
]
"""`messages.ClientId`, anchored at the very end: Python's `$` also matches before a final
newline, pydantic's does not."""


class _View(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    v: Literal[1] = WIRE_VERSION


class RequestView(
    _View, tag_field="type", tag="request", frozen=True, forbid_unknown_fields=True, kw_only=True
):
    """`messages.RequestMsg`, as the orchestrator reads it off the requests stream."""

    request_id: RequestId
    client_id: ClientId
    prompt: Any
    deadline_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    trace: bool = False
    params: dict[str, Any] | None = None


class AbortView(
    _View, tag_field="type", tag="abort", frozen=True, forbid_unknown_fields=True, kw_only=True
):
    """`messages.AbortMsg`, as the orchestrator reads it off the requests stream."""

    request_id: RequestId
    reason: str = "aborted"


ClientCommandView = RequestView | AbortView
"""What may appear on the requests stream (`messages.ClientCommand`), tagged by `type`."""


class StageInputView(_View, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`messages.StageInputMsg`, as a stage's worker reads it."""

    type: Literal["stage_input"]
    request_id: RequestId
    trace: bool = False
    data: Any
    streaming: bool = False
    owner: Seq = 0
    params: dict[str, Any] | None = None


class StageOutputView(_View, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`messages.StageOutputMsg`, as the orchestrator reads it."""

    type: Literal["stage_output"]
    request_id: RequestId
    data: Any
    finished: bool
    error: str | None = None
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
    stage_id: int
    data: Any
    finished: bool
    error: str | None = None
    seq: Seq


MODEL_OF: Final[dict[Any, type[BaseModel] | TypeAdapter[Any]]] = {
    ClientCommandView: TypeAdapter(ClientCommand),
    StageInputView: StageInputMsg,
    StageOutputView: StageOutputMsg,
    StageOutputRelayView: StageOutputMsg,
    OrchOutputView: OrchOutputMsg,
}
"""Each view's model: the authority on whatever the view refuses."""


def is_view(model: object) -> bool:
    return model in MODEL_OF


_DECODERS: dict[tuple[Any, bool], msgspec.msgpack.Decoder[Any]] = {}


def _decoder(view: Any, batches: bool) -> msgspec.msgpack.Decoder[Any]:
    decoder = _DECODERS.get((view, batches))
    if decoder is None:
        decoder = codec.typed_decoder(view | list[view] if batches else view)
        _DECODERS[(view, batches)] = decoder
    return decoder


def decode_views(raw: bytes, view: Any, batches: bool) -> list[Any] | None:
    """The message (or, with `batches`, the batch) in `raw` as views; None when the view
    refuses it (the caller asks the model, for a coerced value or the reason)."""
    try:
        got = _decoder(view, batches).decode(raw)
        msgs = got if isinstance(got, list) else [got]
        if view is StageOutputRelayView:
            for msg in msgs:
                codec.check(msg.data)
    except (msgspec.MsgspecError, CodecError):
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
