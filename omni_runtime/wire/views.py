"""Read-side views of the wire messages read most often, decoded and checked in one pass.

Every request reaches the orchestrator, its stage outputs too, its outputs its client,
one message per chunk, and each stage's worker reads its input. msgspec decodes the bytes
straight into these structs, with the same checks, faster than msgpack then pydantic
(docs/performance.md).

The pydantic models (`messages`) are the one definition of each message: every view is
made from its model when this module is imported (`view_struct`: fields, defaults and
bounds), never written by hand. A view accepts what its model accepts (the models are
strict: nothing is coerced); whatever a view refuses, `redis_io.entries` hands to the
model, which accepts it or says why. So a reader given a view accepts exactly the
messages, values and errors its model would. `tests/unit/test_wire_views.py` and
`tests/unit/test_wire_schema.py` (property tests, hostile values) hold each view to its
model.
"""

from __future__ import annotations

import functools
import operator
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Final, Union, get_args, get_origin

import msgspec
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo

from omni_runtime.errors import CodecError
from omni_runtime.wire import codec
from omni_runtime.wire.messages import (
    AbortMsg,
    ClientCommand,
    OrchOutputMsg,
    RequestMsg,
    StageInputMsg,
    StageOutputMsg,
)

_TAGGED: Final = {"request", "abort"}
"""Messages read as members of a union (the requests stream): tagged by `type`."""


def _pattern(pattern: str) -> str:
    """A pydantic (Rust regex) pattern for Python's `re`, which msgspec uses: `$` there
    also matches before a final newline, `\\Z` does not."""
    if pattern.startswith("^"):
        pattern = "\\A" + pattern[1:]
    if pattern.endswith("$"):
        pattern = pattern[:-1] + "\\Z"
    return pattern


def _meta(metadata: list[Any]) -> dict[str, Any]:
    """The msgspec `Meta` of a pydantic field's constraints."""
    meta: dict[str, Any] = {}
    for item in metadata:
        for name in ("ge", "gt", "le", "lt", "min_length", "max_length"):
            if getattr(item, name, None) is not None:
                meta[name] = getattr(item, name)
        if isinstance(item, FieldInfo):
            meta |= _meta(item.metadata)
        elif getattr(item, "pattern", None) is not None:
            meta["pattern"] = _pattern(item.pattern)
    return meta


def _mirror(annotation: Any) -> Any:
    """A pydantic annotation as the msgspec type that checks the same: constraints become
    `Meta`, containers and unions are mirrored member by member. (A bound float refuses
    `inf` and `nan` in msgspec, as `allow_inf_nan=False` does; a `BeforeValidator` has no
    mirror: what it refuses, the model refuses on the slow path.)"""
    if annotation is Any or annotation is None or annotation is type(None):
        return annotation
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        inner, *metadata = args
        meta = _meta(metadata)
        mirrored = _mirror(inner)
        return Annotated[mirrored, msgspec.Meta(**meta)] if meta else mirrored
    if origin in (Union, UnionType):
        return functools.reduce(operator.or_, [_mirror(a) for a in args])
    if origin is dict:
        return dict.__class_getitem__((_mirror(args[0]), _mirror(args[1])))
    if origin is list:
        return list.__class_getitem__(_mirror(args[0]))
    return annotation  # bool, int, float, str, a Literal


def view_struct(
    model: type[BaseModel], name: str, overrides: dict[str, Any] | None = None
) -> type[msgspec.Struct]:
    """The msgspec struct that decodes and checks what `model` does, made from the model
    (never by hand): every field, default and constraint; `overrides` replaces a field's
    type (`msgspec.Raw` for data kept as read)."""
    tag = model.model_fields["type"].default
    fields: list[tuple[str, Any, Any]] = []
    for field_name, info in model.model_fields.items():
        if field_name == "type" and tag in _TAGGED:
            continue  # the union's tag
        kind = (overrides or {}).get(field_name)
        if kind is None:
            kind = _mirror(
                Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
            )
        if info.is_required() or field_name == "type":  # a reader needs `type` (entries)
            fields.append((field_name, kind, msgspec.NODEFAULT))
        else:
            fields.append((field_name, kind, info.get_default(call_default_factory=True)))
    options: dict[str, Any] = {"tag_field": "type", "tag": tag} if tag in _TAGGED else {}
    return msgspec.defstruct(
        name,
        [(n, k) if d is msgspec.NODEFAULT else (n, k, d) for n, k, d in fields],
        frozen=True,
        forbid_unknown_fields=True,
        kw_only=True,
        module=__name__,
        **options,
    )


if TYPE_CHECKING:  # to the type checker a view is its model: the same fields, by making
    RequestView = RequestMsg
    AbortView = AbortMsg
    ClientCommandView = RequestMsg | AbortMsg
    StageInputView = StageInputMsg
    StageOutputView = StageOutputMsg
    StageOutputRelayView = StageOutputMsg
    OrchOutputView = OrchOutputMsg
else:
    RequestView = view_struct(RequestMsg, "RequestView")
    """`messages.RequestMsg`, as the orchestrator reads it off the requests stream."""
    AbortView = view_struct(AbortMsg, "AbortView")
    """`messages.AbortMsg`, as the orchestrator reads it off the requests stream."""
    ClientCommandView = RequestView | AbortView
    """What may appear on the requests stream (`messages.ClientCommand`), tagged by `type`."""
    StageInputView = view_struct(StageInputMsg, "StageInputView")
    """`messages.StageInputMsg`, as a stage's worker reads it."""
    StageOutputView = view_struct(StageOutputMsg, "StageOutputView")
    """`messages.StageOutputMsg`, as the orchestrator reads it."""
    StageOutputRelayView = view_struct(
        StageOutputMsg, "StageOutputRelayView", overrides={"data": msgspec.Raw}
    )
    """`StageOutputView` with its data kept as read (`msgspec.Raw`), checked by
    `codec.check`: a streaming orchestrator only relays a stage's data to the client (and
    holds it), so decoding an array only to encode it again was a fifth of its CPU. (On
    the slow path, a message its model had to accept, `data` is the decoded value.)"""
    OrchOutputView = view_struct(OrchOutputMsg, "OrchOutputView")
    """`messages.OrchOutputMsg`, as a client reads it."""


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
        whole = codec.shallow(raw, _PAYLOAD_DEPTH)  # then so is every field in it
        for msg in msgs:
            if type(msg) is StageOutputRelayView:
                codec.check(msg.data, _PAYLOAD_DEPTH, shallow_known=whole)
                continue
            if whole:
                continue
            free = _FREE_FORM.get(type(msg))
            if free is not None and not codec.within(getattr(msg, free), _PAYLOAD_DEPTH):
                return None
    except (msgspec.MsgspecError, CodecError, RecursionError):  # deep: `decode` says why
        return None
    return msgs


_MEMBER_OF: Final[dict[type[BaseModel], Any]] = {
    RequestMsg: RequestView,
    AbortMsg: AbortView,
}
"""A union view's member for each model its model may give."""


def view_of(msg: BaseModel, view: Any) -> Any:
    """A message its model accepted, as `view` (the slow path's result, same shape)."""
    one: Any = view if isinstance(view, type) else _MEMBER_OF[type(msg)]
    return one(**{name: getattr(msg, name) for name in one.__struct_fields__})
