"""What each writer builds: a struct per message, made from its model, encoded by msgspec.

The pydantic models (`messages`) are the one definition of each message. A writer does
not build the model: validating, on every output, fields the writer made itself would
cost more than encoding them (`benchmarks/micro.py`, docs/performance.md). Nor does it
spell the message out as a dict. It builds the message's struct, made from the model
when this module is imported (`out_struct`): the model's field names in its order, its
required fields, its defaults (`type` and `v` among them). A misspelt field or a missing
required one is a `TypeError` where the message is made, and to the type checker each
struct is its model, so mypy checks every call. `tests/unit/test_wire_outgoing.py` holds
each struct to its model field by field, and what each writer encodes to what its
model accepts.

`encode` writes a struct as the map its model reads, by msgspec. The values a writer
puts in are ones a reader decoded (a request's prompt and parameters, a stage's output
relayed), or come from stage code: the fields `USER_DATA` names. Those are encoded by
`codec.encode_raw` (msgpack, which refuses whatever the wire format does not name),
unless the writer did that already to use the bytes twice (a stage's output and its chunk).
"""

from __future__ import annotations

from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Final, TypeVar, Union, cast, get_args, get_origin

import msgspec
from pydantic import BaseModel

from omni_runtime.wire import codec
from omni_runtime.wire.messages import DurableRequest, OrchOutputMsg, StageInputMsg, StageOutputMsg


def out_struct(model: type[BaseModel], name: str) -> type[msgspec.Struct]:
    """The struct a writer builds for `model` (never written by hand): its fields in its
    order, required where it requires them, else with its default. Values are not checked
    here: the writer made them, and every reader checks them against the model."""
    fields = [
        (n, Any) if info.is_required() else (n, Any, info.get_default(call_default_factory=True))
        for n, info in model.model_fields.items()
    ]
    return msgspec.defstruct(name, fields, kw_only=True, frozen=True, module=__name__)


def _free_form(annotation: Any) -> bool:
    """Whether a field of this annotation holds values of any shape (`Any` within it)."""
    if annotation is Any:
        return True
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _free_form(args[0])
    return origin in (Union, UnionType, list, dict) and any(_free_form(a) for a in args)


if TYPE_CHECKING:  # to the type checker a struct is its model: the same fields, by making
    StageInputOut = StageInputMsg
    StageOutputOut = StageOutputMsg
    OrchOutputOut = OrchOutputMsg
    DurableRequestOut = DurableRequest
    Out = StageInputMsg | StageOutputMsg | OrchOutputMsg | DurableRequest
else:
    StageInputOut = out_struct(StageInputMsg, "StageInputOut")
    """`messages.StageInputMsg`, as the orchestrator submits it to a stage."""
    StageOutputOut = out_struct(StageOutputMsg, "StageOutputOut")
    """`messages.StageOutputMsg`, as a stage's worker writes it."""
    OrchOutputOut = out_struct(OrchOutputMsg, "OrchOutputOut")
    """`messages.OrchOutputMsg`, as the orchestrator writes it to a client."""
    DurableRequestOut = out_struct(DurableRequest, "DurableRequestOut")
    """`messages.DurableRequest`, as the orchestrator keeps a request's state."""
    Out = StageInputOut | StageOutputOut | OrchOutputOut | DurableRequestOut

MODEL_OF: Final[dict[Any, type[BaseModel]]] = {
    StageInputOut: StageInputMsg,
    StageOutputOut: StageOutputMsg,
    OrchOutputOut: OrchOutputMsg,
    DurableRequestOut: DurableRequest,
}
"""Each struct's model: its definition."""

USER_DATA: Final[dict[Any, str]] = {StageInputOut: "data", StageOutputOut: "data"}
"""The field of a message that carries a value from stage code (an engine's output,
`forward_fn`'s): encoded by msgpack's rules (`codec.encode_raw`), never msgspec's."""

_AS_IS: Final = frozenset((msgspec.Raw, type(None), bool, int, float, str, bytes))
"""Values msgspec writes as msgpack would (or refuses as it would): no `encode_raw`."""

_FREE_FORM: Final[dict[Any, tuple[str, ...]]] = {
    struct: tuple(n for n, info in model.model_fields.items() if _free_form(info.annotation))
    for struct, model in MODEL_OF.items()
}
"""Each struct's fields of free form (a prompt, a stage's data): how deep they nest is
bounded here. The others' shapes are their model's (a list of ints, a map of scalars)."""

M = TypeVar("M")


def encode(msg: Out) -> bytes:
    """The message's bytes: its model's map. `CodecError` for a value that cannot travel
    (the wire format does not name it, or it nests deeper than `codec.MAX_DEPTH`)."""
    kind = type(msg)
    user = USER_DATA.get(kind)
    if user is not None and type(getattr(msg, user)) not in _AS_IS:
        msg = replace(msg, **{user: codec.encode_raw(getattr(msg, user))})
    for name in _FREE_FORM[kind]:
        codec.check_field(getattr(msg, name))
    return codec.encode_decoded(msg)


def replace(msg: M, **changes: Any) -> M:
    """`msg` with `changes` (a struct is frozen, as its model is)."""
    return cast("M", msgspec.structs.replace(cast("Any", msg), **changes))
