"""Wire codec: every message on Redis is msgpack, never pickle.

msgpack is compact, sub-microsecond for a typical envelope, language-neutral, and carries
binary payloads as ``bin`` without base64. numpy arrays travel as one ext type so dtype and
shape survive; numpy stays optional (it is imported only when an array is actually met).

Type mapping (what ``decode(encode(x))`` gives back):

* None, bool, int (-2**63 .. 2**64-1), float, str: unchanged.
* datetime with a tzinfo: a msgpack timestamp, which decodes as a UTC datetime (naive
  datetimes are refused: their instant is unknown).
* bytes / bytearray / memoryview: ``bytes``. tuple / list: ``list`` (msgpack has one array type).
* dict: ``dict``; keys should be str, int or bytes (an array key decodes as a tuple).
* numpy ndarray: read-only ndarray with the same dtype and shape (object and structured dtypes
  are refused). numpy scalars: the equivalent Python scalar.

Arrays are one ext (code ``NDARRAY_EXT_CODE``), laid out in `ndarray`. ``decode`` is the
door for untrusted bytes, so any failure there surfaces as exactly ``CodecError``.

Containers nest at most ``MAX_DEPTH`` levels (an array at the root, a batch of messages,
does not count): deeper is a ``CodecError`` both ways, so nothing this process writes is
refused by a reader, and no later recursion (msgspec's ends in a bare ``RecursionError``
near 1,000 levels, msgpack's at 511, pydantic's) ever meets a value read off a stream.

Encoding is msgpack's (its ``default`` hook refuses what the mapping above does not
name; msgspec's encoder would turn sets, dataclasses or UUIDs into something else
silently). Decoding is msgspec's: the same objects, parsed 2-3x faster, which every
message of every hop pays.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final, TypeVar

import msgpack
import msgspec
from pydantic import BaseModel, ValidationError

from omni_runtime.errors import CodecError
from omni_runtime.wire import ndarray
from omni_runtime.wire.ndarray import NDARRAY_EXT_CODE

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_DEPTH",
    "NDARRAY_EXT_CODE",
    "decode",
    "decode_model",
    "encode",
    "encode_decoded",
    "encode_model",
    "encode_raw",
    "typed_decoder",
    "warm_up",
]

DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
"""Refuse bigger inputs before parsing: a bound on what one bad message can cost."""
MAX_DEPTH: Final = 64
"""How deep lists and maps may nest in one message (its map is level 1; a batch's array at
the root is free). Part of the wire format, like the message schemas: not a setting."""


M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def warm_up() -> None:
    """Import numpy now, if installed: a long-running process that would otherwise import it
    on its first array stalls everything else for ~0.2 s right then (first-request latency)."""
    with contextlib.suppress(ImportError):
        import numpy  # noqa: F401


def encode(obj: Any) -> bytes:
    """Serialize ``obj`` to msgpack; unsupported types raise CodecError naming the type.

    Each thread keeps one packer: `msgpack.packb` makes a new one per call, and getting
    its buffer cost more than the packing itself for a small message (docs/performance.md). A packer that failed, is in use further up this thread's stack,
    or grew past `_PACKER_KEEP_BYTES` is not kept."""
    try:
        data = _pack(obj)
    except CodecError:
        check_depth(obj)  # too deep for the packer too: say so
        raise
    if not shallow(data, MAX_DEPTH):
        check_depth(obj)
    return data


def encode_raw(obj: Any, max_depth: int = MAX_DEPTH - 1) -> msgspec.Raw:
    """`encode` of a value that sits inside a message (`max_depth`: what is left of
    `MAX_DEPTH` there, one level below the message's map), as `msgspec.Raw`: the message
    around it goes to `encode_decoded`, which writes these bytes as they are. So a value
    from user code is encoded by `encode`'s rules, once, however many messages carry it."""
    check_field(obj, max_depth)
    return msgspec.Raw(_pack(obj))


def _pack(obj: Any) -> bytes:
    packer: msgpack.Packer | None = getattr(_PACKERS, "packer", None)
    _PACKERS.packer = None  # taken: a re-entrant call makes its own
    if packer is None:
        packer = msgpack.Packer(use_bin_type=True, datetime=True, default=_default)
    try:
        data: bytes = packer.pack(obj)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError, BufferError) as e:
        raise CodecError(f"cannot encode: {e}") from e
    if len(data) <= _PACKER_KEEP_BYTES:
        _PACKERS.packer = packer
    return data


def encode_decoded(obj: Any) -> bytes:
    """`encode` for a value built only of what `decode` returns (a read message's data, in
    containers of the types in the mapping above): the same bytes, ~4x sooner, by msgspec.

    Never for a value from user code: msgspec encodes sets, dataclasses, naive datetimes
    and more, which `encode` refuses. Hand those to `encode`, or to `encode_raw` first: a
    `msgspec.Raw` is written as it is, and so is a message struct (`wire.outgoing`)."""
    try:
        data = _ENCODER.encode(obj)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError, BufferError, RecursionError) as e:
        check_depth(obj)
        raise CodecError(f"cannot encode: {e}") from e
    if not shallow(data, MAX_DEPTH):
        check_depth(obj)
    return data


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
) -> Any:
    """Parse msgpack bytes; oversize or malformed input of any kind raises CodecError.

    Decoded arrays are read-only views over one copy of their ext payload (the copy
    msgpack's own unpacker made too), aligned whatever the message's layout.
    """
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if max_bytes is not None and size > max_bytes:
        raise CodecError(f"message of {size} bytes exceeds the limit of {max_bytes} bytes")
    try:
        obj = _DECODER.decode(data)
    except (RecursionError, msgspec.DecodeError, TypeError) as e:  # the ext hook's
        raise _decode_failed(e, MAX_DEPTH) from e  # CodecError passes as it is
    if not shallow(data, MAX_DEPTH):
        check_depth(obj)
    return obj


def typed_decoder(type_: Any) -> msgspec.msgpack.Decoder[Any]:
    """A decoder straight into `type_` (msgspec structs, lists of them), with the same
    array ext as `decode`; it raises msgspec's errors, or CodecError for a bad array."""
    return msgspec.msgpack.Decoder(type_, ext_hook=_ext_hook)


def check(raw: Any, max_depth: int = MAX_DEPTH, *, shallow_known: bool = False) -> None:
    """Raise `CodecError` where `decode` would (malformed msgpack, a bad array, too deep),
    without building arrays: for data kept as read (`msgspec.Raw`) and relayed as is;
    `max_depth`: what is left of `MAX_DEPTH` where the data sits in its message;
    `shallow_known`: the message around it was found `shallow` (so is every part of it)."""
    try:
        obj = _CHECKER.decode(raw)
    except (RecursionError, msgspec.DecodeError, TypeError) as e:  # the ext hook's
        raise _decode_failed(e, max_depth) from e  # CodecError passes as it is
    if not (shallow_known or shallow(raw, max_depth) or within(obj, max_depth)):
        raise CodecError(_too_deep(max_depth))


def check_depth(obj: Any) -> None:
    """`CodecError` if `obj` nests deeper than `MAX_DEPTH` (a root array: one more)."""
    if not within(obj, MAX_DEPTH + 1 if type(obj) is list else MAX_DEPTH):
        raise CodecError(_too_deep(MAX_DEPTH))


def check_field(obj: Any, max_depth: int = MAX_DEPTH - 1) -> None:
    """`CodecError` if a message's field nests deeper than what is left of `MAX_DEPTH`
    there (`max_depth`: one level below the message's map)."""
    if not within(obj, max_depth):
        raise CodecError(_too_deep(MAX_DEPTH))


_NESTING: Final = frozenset((list, dict, tuple))
_HEADS: Final = bytes(int(0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF) for b in range(256))
"""1 for each byte that can begin a msgpack array or map, 0 for the others."""
_SHALLOW_SCAN_BYTES: Final = 4096
"""Encoded messages up to this size are scanned for `shallow`; bigger ones (audio, mostly
bytes in few containers) are walked, which costs them less than a scan."""


def shallow(data: Any, depth: int) -> bool:
    """Whether encoded bytes surely nest at most `depth` levels: each level of lists and maps
    begins with a header byte of its own, so having no more such bytes than `depth` is
    proof. One C pass over a small message, where `within` makes a Python call per
    container of the decoded value (most of a small message's decoding). False means
    only "walk it"."""
    if len(data) <= depth:
        return True
    if len(data) > _SHALLOW_SCAN_BYTES or not isinstance(data, bytes | bytearray):
        return False
    return data.translate(_HEADS).count(1) <= depth


def within(obj: Any, depth: int) -> bool:
    """Whether `obj` nests at most `depth` levels of lists and maps (tuples: decoded map
    keys). Only containers are visited, a level of scalars in one C pass (`map(type)`), so
    the check costs about what the encoding does, not more."""
    kind = type(obj)
    if kind is dict:
        if depth <= 0:
            return False
        if not _NESTING.isdisjoint(map(type, obj)) and not all(within(k, depth - 1) for k in obj):
            return False
        items: Any = obj.values()
    elif kind is list or kind is tuple:
        if depth <= 0:
            return False
        items = obj
    else:
        return True
    if _NESTING.isdisjoint(map(type, items)):
        return True
    return all(within(x, depth - 1) for x in items if type(x) in _NESTING)


def _decode_failed(e: Exception, max_depth: int) -> CodecError:
    """A decode's failure as the caller sees it: too deep, or malformed msgpack (msgspec's
    ValidationError is a DecodeError; an array's header too), or no bytes at all."""
    if isinstance(e, RecursionError):
        return CodecError(_too_deep(max_depth))
    return CodecError(f"malformed message: {type(e).__name__}: {e}")


def _too_deep(depth: int) -> str:
    return f"nested deeper than {depth} levels of lists and maps"


_EXT_TYPE_AT: Final = {0xD4: 1, 0xD5: 1, 0xD6: 1, 0xD7: 1, 0xD8: 1, 0xC7: 2, 0xC8: 3, 0xC9: 5}
"""msgpack's ext formats: where each one's type byte is."""


def is_array(raw: Any) -> bool:
    """Whether encoded bytes (or a `msgspec.Raw`) hold one array, by their first bytes."""
    head = memoryview(raw)[:6]
    at = _EXT_TYPE_AT.get(head[0]) if len(head) else None
    return at is not None and len(head) > at and head[at] == NDARRAY_EXT_CODE


BATCH_HEADER_BYTES: Final = 5
"""The most a batch adds to its messages' bytes (a msgpack array header)."""
BATCH_MAX_BYTES: Final = 256 * 1024
"""The largest batch the writers make of messages bound for one stream. Batching saves an
XADD and its Python per message, but a batch is a copy of its messages made at once, in
the writer's loop, and read back in one go: unbounded, a burst of answers' audio made
one entry of megabytes (docs/performance.md)."""


def encode_batch(encoded: Sequence[bytes]) -> bytes:
    """A msgpack array of messages already encoded one by one: one entry carries several
    without decoding or encoding them again (an array header, then the bytes as they are)."""
    n = len(encoded)
    if n < 16:
        header = bytes((0x90 | n,))
    elif n < 1 << 16:
        header = b"\xdc" + n.to_bytes(2, "big")
    else:
        header = b"\xdd" + n.to_bytes(4, "big")
    return b"".join((header, *encoded))  # one copy of the messages, not two


def batches(
    items: Sequence[T],
    size: Callable[[T], int],
    max_bytes: int,
    unit: Callable[[T], Hashable] | None = None,
) -> list[list[T]]:
    """Consecutive `items` as few batches as fit in `max_bytes` (at most `BATCH_MAX_BYTES`)
    each, a batch's header counted; an item too big for any batch is one alone.

    With `unit` (a request's id), the items of one unit are gathered, in order, where its
    first one was, and a unit goes whole into one batch when it fits in one: a request's
    messages then never straddle two entries, which Redis short of memory could write
    out of order (`write_ops.first_wave`). A unit too big for one batch is cut where it
    must, as items are."""
    limit = min(max_bytes, BATCH_MAX_BYTES) - BATCH_HEADER_BYTES
    if unit is None:
        return _packed([([item], size(item)) for item in items], limit)
    units: dict[Hashable, list[T]] = {}
    for item in items:
        units.setdefault(unit(item), []).append(item)
    pieces: list[tuple[list[T], int]] = []
    for group in units.values():
        sizes = [size(item) for item in group]
        weight = sum(sizes)
        if weight > limit:
            pieces.extend(([item], one) for item, one in zip(group, sizes, strict=True))
        else:
            pieces.append((group, weight))
    return _packed(pieces, limit)


def _packed(pieces: list[tuple[list[T], int]], limit: int) -> list[list[T]]:
    """The pieces (items, their weight), each whole and in order, greedily into batches of
    at most `limit`."""
    out: list[list[T]] = []
    group: list[T] = []
    total = 0
    for piece, weight in pieces:
        if group and total + weight > limit:
            out.append(group)
            group, total = [], 0
        group.extend(piece)
        total += weight
    if group:
        out.append(group)
    return out


def encode_model(model: BaseModel) -> bytes:
    """Encode a pydantic model as its python-mode dump (bytes fields stay bytes)."""
    return encode(model.model_dump(mode="python"))


def decode_model(
    data: bytes | bytearray | memoryview,
    model_cls: type[M],
    *,
    max_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
) -> M:
    """Decode and validate in one step, so no unvalidated message reaches the caller."""
    obj = decode(data, max_bytes=max_bytes)
    try:
        return model_cls.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0] if errors else {"loc": (), "msg": str(e)}
        loc = ".".join(str(part) for part in first["loc"]) or "<root>"
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise CodecError(f"invalid {model_cls.__name__}: {loc}: {first['msg']}{more}") from e


def _default(obj: object) -> Any:
    """msgpack fallback for types it does not know; the only place numpy is considered."""
    if sys.modules.get("numpy") is not None:  # numpy never imported -> obj is no numpy object
        import numpy as np

        if isinstance(obj, np.ndarray):
            return msgpack.ExtType(NDARRAY_EXT_CODE, ndarray.payload(obj))
        if isinstance(obj, np.generic):
            return obj.item()
    raise CodecError(
        f"cannot encode object of type {type(obj).__module__}.{type(obj).__qualname__}"
    )


def _ext_hook(code: int, view: memoryview) -> Any:
    if code != NDARRAY_EXT_CODE:
        raise CodecError(f"unknown msgpack ext type {code}")
    return ndarray.array(view)


def _check_hook(code: int, view: memoryview) -> None:
    if code != NDARRAY_EXT_CODE:
        raise CodecError(f"unknown msgpack ext type {code}")
    ndarray.check(view)


def _ext_default(obj: object) -> Any:
    """`_default` for msgspec's encoder: an array as its ext, a numpy scalar as Python's."""
    out = _default(obj)
    return msgspec.msgpack.Ext(out.code, out.data) if isinstance(out, msgpack.ExtType) else out


_PACKERS = threading.local()
_PACKER_KEEP_BYTES: Final = 1 << 20
"""A packer keeps the buffer of the biggest message it packed: past this, not kept."""
_ENCODER: Final = msgspec.msgpack.Encoder(enc_hook=_ext_default)
_DECODER: Final = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
"""Any msgpack to Python objects; thread-safe, made once."""
_CHECKER: Final = msgspec.msgpack.Decoder(ext_hook=_check_hook)
