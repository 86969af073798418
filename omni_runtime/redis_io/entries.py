"""The format of a control-plane stream entry, and the pure half of reading a stream.

Every entry is exactly one field, `keys.PAYLOAD_FIELD`, holding a msgpack wire
message that names its `type`, or an array of them (a batch: several messages for
one reader in one entry, see `codec.encode_batch`). Nothing here does I/O: `streams` wraps it in
readers and the dead-letter path (import from there). Writers and the client use the
format alone (`entry_fields`, `parse_entries`), without a reader.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel, TypeAdapter, ValidationError
from redis.exceptions import ResponseError

from omni_runtime import keys
from omni_runtime.errors import CodecError
from omni_runtime.wire import codec
from omni_runtime.wire.views import MODEL_OF, decode_views, is_view, view_of

log = logging.getLogger(__name__)

M = TypeVar("M")
Entry = tuple[bytes, Mapping[bytes, bytes]]
"""(entry id, fields) as redis-py returns them; no fields for a pending entry trimmed since."""
DEAD_LETTER_RAW_BYTES = 4096
"""How much of a malformed entry's payload the dead-letter stream keeps."""
_PAYLOAD = keys.PAYLOAD_FIELD.encode()


def entry_fields(msg: BaseModel) -> dict[str, bytes]:
    """The fields of the entry carrying `msg`: its encoding under the one payload field."""
    return {keys.PAYLOAD_FIELD: codec.encode_model(msg)}


def stream_reply(reply: object) -> list[tuple[bytes, list[Entry]]]:
    """An XREAD / XREADGROUP reply, `[]` if none: `[[stream, [(id, fields), ...]], ...]`.

    Only states the type: our clients keep redis-py's defaults (bytes, RESP2 shapes),
    which its stubs over-approximate.
    """
    return cast("list[tuple[bytes, list[Entry]]]", reply or [])


_ADAPTERS: dict[type, TypeAdapter[Any]] = {}


def adapter_of(model: type[M] | TypeAdapter[M]) -> TypeAdapter[M]:
    """A model class or a `TypeAdapter` (for a discriminated union) as one validator; one
    per class, made once (building one costs more than validating many messages)."""
    if isinstance(model, TypeAdapter):
        return model
    adapter = _ADAPTERS.get(model)
    if adapter is None:
        adapter = _ADAPTERS[model] = TypeAdapter(model)
    return cast("TypeAdapter[M]", adapter)


def parse_entry(
    fields: Mapping[bytes, bytes], model: type[M] | TypeAdapter[M], max_bytes: int
) -> M:
    """Validate one entry of one message into `model`; else raise `CodecError` saying why."""
    if is_view(model):
        return _views(fields, model, max_bytes, False)[0]  # type: ignore[no-any-return]
    obj = _payload(fields, max_bytes)
    if isinstance(obj, list):
        raise CodecError("expected one message, got a batch")
    return _validate(obj, adapter_of(model))


def parse_entries(
    fields: Mapping[bytes, bytes], model: type[M] | TypeAdapter[M], max_bytes: int
) -> list[M]:
    """Validate an entry of one message or a batch of them; one bad message fails it whole.

    `model` may be a pydantic model, a `TypeAdapter`, or a `wire.views` view (decoded in
    one pass; what the view refuses, its model decides)."""
    if is_view(model):
        return _views(fields, model, max_bytes, True)
    obj = _payload(fields, max_bytes)
    adapter = adapter_of(model)
    if isinstance(obj, list):
        return [_validate(one, adapter) for one in obj]
    return [_validate(obj, adapter)]


def _views(fields: Mapping[bytes, bytes], view: Any, max_bytes: int, batches: bool) -> list[Any]:
    raw = fields.get(_PAYLOAD)
    if raw is not None and len(fields) == 1 and len(raw) <= max_bytes:
        got = decode_views(raw, view, batches)
        if got is not None:
            return got
    model = MODEL_OF[view]
    if batches:
        return [view_of(msg, view) for msg in parse_entries(fields, model, max_bytes)]
    return [view_of(parse_entry(fields, model, max_bytes), view)]


def _payload(fields: Mapping[bytes, bytes], max_bytes: int) -> Any:
    raw = fields.get(_PAYLOAD)
    if raw is None or len(fields) != 1:
        raise CodecError(f"entry must have exactly the field {keys.PAYLOAD_FIELD!r}")
    return codec.decode(raw, max_bytes=max_bytes)


def _validate(obj: Any, adapter: TypeAdapter[M]) -> M:
    if not isinstance(obj, dict) or "type" not in obj:
        raise CodecError("message must be a map with a 'type' field")
    try:
        return adapter.validate_python(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        loc = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
        first = errors[0]["msg"] if errors else str(e)
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        kind = str(obj["type"])[:64]
        raise CodecError(f"invalid {kind} message: {loc or '<root>'}: {first}{more}") from e


def dead_letter_fields(
    stream: str, entry_id: bytes, error: str, fields: Mapping[bytes, bytes] | None
) -> dict[str, Any]:
    """What the dead-letter stream keeps of a bad entry: where, why, and its first bytes."""
    raw = b"".join(fields.values())[:DEAD_LETTER_RAW_BYTES] if fields else b""
    return {"stream": stream, "id": entry_id, "error": error[:1000], "raw": raw}


def no_group(e: ResponseError) -> bool:
    """The group or its stream vanished (Redis flushed: UNBLOCKED while blocked in the
    read; fakeredis words a vanished stream its own way)."""
    text = str(e)
    return any(m in text for m in ("NOGROUP", "UNBLOCKED", "requires the key to exist"))


class BacklogCursor:
    """The id to read from: this consumer's pending backlog from "0", then ">" (new entries).

    Walking the backlog re-delivers what a previous run read but never acknowledged,
    so nothing is lost in a crash; the walk ends at the first empty reply.
    """

    def __init__(self, backlog_first: bool = True) -> None:
        self.next_id = "0" if backlog_first else ">"

    @property
    def in_backlog(self) -> bool:
        return self.next_id != ">"

    def advance(self, entries: Sequence[Entry]) -> None:
        if self.next_id != ">":
            self.next_id = entries[-1][0].decode() if entries else ">"


class SortedEntries(Generic[M]):
    """One read split into the valid, the malformed (with why) and the trimmed entries.

    `batches`: an entry may carry several messages; each is in `good` with its entry's id.
    """

    def __init__(
        self,
        entries: Sequence[Entry],
        model: type[M] | TypeAdapter[M],
        max_bytes: int,
        batches: bool,
    ) -> None:
        self.good: list[tuple[bytes, M]] = []
        self.bad: list[tuple[bytes, Mapping[bytes, bytes], str]] = []
        self.trimmed: list[bytes] = []
        for entry_id, fields in entries:
            if not fields:
                self.trimmed.append(entry_id)
                continue
            try:
                if batches:
                    msgs = parse_entries(fields, model, max_bytes)
                    self.good.extend((entry_id, msg) for msg in msgs)
                else:
                    self.good.append((entry_id, parse_entry(fields, model, max_bytes)))
            except CodecError as e:  # untrusted: whatever breaks on it is refused as one
                self.bad.append((entry_id, fields, str(e)))
