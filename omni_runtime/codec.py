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

Array ext payload (code ``NDARRAY_EXT_CODE``)::

    u16 LE header length | header = msgpack [dtype.str, shape] | zero pad to 16 | raw C bytes

The pad keeps the decoded zero-copy view aligned for every dtype. ``decode`` is the door for
untrusted bytes, so any failure there surfaces as exactly ``CodecError``.

Encoding is msgpack's (its ``default`` hook refuses what the mapping above does not
name; msgspec's encoder would turn sets, dataclasses or UUIDs into something else
silently). Decoding is msgspec's: the same objects, parsed 2-3x faster, which every
message of every hop pays.
"""

from __future__ import annotations

import contextlib
import math
import re
import struct
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import msgpack
import msgspec
from pydantic import BaseModel, ValidationError

from omni_runtime.errors import CodecError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "NDARRAY_EXT_CODE",
    "decode",
    "decode_model",
    "encode",
    "encode_decoded",
    "encode_model",
    "typed_decoder",
    "warm_up",
]

DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
"""Refuse bigger inputs before parsing: a bound on what one bad message can cost."""

NDARRAY_EXT_CODE: Final = 1

M = TypeVar("M", bound=BaseModel)

_ALIGN: Final = 16
_HLEN: Final = struct.Struct("<H")
_MAX_NDIM: Final = 64
# Canonical ``dtype.str`` only (what encode emits): no object "O", no structured specs, and no
# odd spellings numpy would parse with a deprecation warning.
_DTYPE_RE: Final = re.compile(r"[<>|][biufcmMSUV][0-9]{1,10}(?:\[[0-9]{0,10}[A-Za-z]{1,7}\])?")


def warm_up() -> None:
    """Import numpy now, if installed: a long-running process that would otherwise import it
    on its first array stalls everything else for ~0.2 s right then (first-request latency)."""
    with contextlib.suppress(ImportError):
        import numpy  # noqa: F401


def encode(obj: Any) -> bytes:
    """Serialize ``obj`` to msgpack; unsupported types raise CodecError naming the type."""
    try:
        data: bytes = msgpack.packb(obj, use_bin_type=True, datetime=True, default=_default)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError, BufferError) as e:
        raise CodecError(f"cannot encode: {e}") from e
    return data


def encode_decoded(obj: Any) -> bytes:
    """`encode` for a value built only of what `decode` returns (a read message's data, in
    containers of the types in the mapping above): the same bytes, ~4x sooner, by msgspec.

    Never for a value from user code: msgspec encodes sets, dataclasses, naive datetimes
    and more, which `encode` refuses. Hand those to `encode`."""
    try:
        return _ENCODER.encode(obj)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError, BufferError) as e:
        raise CodecError(f"cannot encode: {e}") from e


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
        return _DECODER.decode(data)
    except CodecError:
        raise
    except Exception as e:  # untrusted bytes: whatever breaks is the message's fault
        raise CodecError(f"malformed message: {type(e).__name__}: {e}") from e


def typed_decoder(type_: Any) -> msgspec.msgpack.Decoder[Any]:
    """A decoder straight into `type_` (msgspec structs, lists of them), with the same
    array ext as `decode`; it raises msgspec's errors, or CodecError for a bad array."""
    return msgspec.msgpack.Decoder(type_, ext_hook=_ext_hook)


BATCH_HEADER_BYTES: Final = 5
"""The most a batch adds to its messages' bytes (a msgpack array header)."""


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
    return header + b"".join(encoded)


def pack_batches(encoded: Sequence[bytes], max_bytes: int) -> list[bytes]:
    """Consecutive encoded messages as few payloads as fit in `max_bytes` each, in order:
    a batch (`encode_batch`) of several, or a lone message as it is."""
    out: list[bytes] = []
    group: list[bytes] = []
    size = 0
    for one in encoded:
        if group and size + len(one) > max_bytes - BATCH_HEADER_BYTES:
            out.append(group[0] if len(group) == 1 else encode_batch(group))
            group, size = [], 0
        group.append(one)
        size += len(one)
    if group:
        out.append(group[0] if len(group) == 1 else encode_batch(group))
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
            return _pack_array(obj)
        if isinstance(obj, np.generic):
            return obj.item()
    raise CodecError(
        f"cannot encode object of type {type(obj).__module__}.{type(obj).__qualname__}"
    )


def _pad_to(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _pack_array(arr: npt.NDArray[Any]) -> msgpack.ExtType:
    import numpy as np

    dt = arr.dtype
    if dt.hasobject or dt.fields is not None or dt.itemsize == 0:
        raise CodecError(f"cannot encode numpy array of dtype {dt}: object/structured/empty")
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")  # the only extra copy, and only for strided input
    header = msgpack.packb([dt.str, list(arr.shape)], use_bin_type=True)
    start = _pad_to(_HLEN.size + len(header))
    prefix = _HLEN.pack(len(header)) + header + bytes(start - _HLEN.size - len(header))
    raw = arr.reshape(-1).view(np.uint8).data  # memoryview over arr, no tobytes()
    # ExtType insists on bytes, so joining prefix and buffer is the one unavoidable copy.
    return msgpack.ExtType(NDARRAY_EXT_CODE, b"".join((prefix, raw)))


def _ext_hook(code: int, view: memoryview) -> Any:
    """Rebuild an array as a zero-copy, read-only view over a copy of the ext payload (the
    ``view`` msgspec hands in points into the message at any offset: not aligned, and
    writable when the message was); check every field."""
    data = bytes(view)
    if code != NDARRAY_EXT_CODE:
        raise CodecError(f"unknown msgpack ext type {code}")
    try:
        import numpy as np
    except ImportError as e:
        raise CodecError("message carries a numpy array but numpy is not installed") from e
    (hlen,) = _HLEN.unpack_from(data)
    start = _pad_to(_HLEN.size + hlen)
    if start > len(data):
        raise CodecError("array ext: truncated header")
    header = _HEADER_DECODER.decode(data[_HLEN.size : _HLEN.size + hlen])
    if not (isinstance(header, list) and len(header) == 2):
        raise CodecError("array ext: header is not [dtype, shape]")
    dtype_str, shape = header
    if not (isinstance(dtype_str, str) and _DTYPE_RE.fullmatch(dtype_str)):
        raise CodecError(f"array ext: bad dtype {dtype_str!r}")
    if not (
        isinstance(shape, list)
        and len(shape) <= _MAX_NDIM
        and all(type(d) is int and d >= 0 for d in shape)
    ):
        raise CodecError(f"array ext: bad shape {shape!r}")
    dt: np.dtype[Any] = np.dtype(dtype_str)
    if dt.str != dtype_str or dt.itemsize == 0:
        raise CodecError(f"array ext: non-canonical dtype {dtype_str!r}")
    count = math.prod(shape)
    if count * dt.itemsize != len(data) - start:
        raise CodecError("array ext: data length does not match dtype and shape")
    return np.frombuffer(memoryview(data)[start:], dtype=dt, count=count).reshape(shape)


def _ext_default(obj: object) -> Any:
    """`_default` for msgspec's encoder: an array as its ext, a numpy scalar as Python's."""
    out = _default(obj)
    return msgspec.msgpack.Ext(out.code, out.data) if isinstance(out, msgpack.ExtType) else out


_ENCODER: Final = msgspec.msgpack.Encoder(enc_hook=_ext_default)
_DECODER: Final = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
"""Any msgpack to Python objects; thread-safe, made once."""
_HEADER_DECODER: Final = msgspec.msgpack.Decoder()
"""An array ext's header, decoded from inside `_DECODER`'s hook."""
