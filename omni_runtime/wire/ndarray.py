"""The numpy array as one msgpack ext (code `NDARRAY_EXT_CODE`), both ways, for `codec`.

Payload::

    u16 LE header length | header = msgpack [dtype.str, shape] | zero pad to 16 | raw C bytes

The pad keeps the decoded zero-copy view aligned for every dtype. Both ways remember
what they worked out per header: a stream of audio chunks has few dtypes and shapes,
and building or checking the header was most of an array's cost (packing it with
msgpack, nested inside the encode that met the array, took a second packer's buffer:
most of the array's cost). The payload's length is checked on every array, never remembered.
numpy is imported only here, and only when an array is met.
"""

from __future__ import annotations

import math
import re
import struct
from typing import TYPE_CHECKING, Any, Final

import msgspec

from omni_runtime.errors import CodecError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

NDARRAY_EXT_CODE: Final = 1

_ALIGN: Final = 16
_HLEN: Final = struct.Struct("<H")
_MAX_NDIM: Final = 64
# Canonical ``dtype.str`` only (what encode emits): no object "O", no structured specs, and no
# odd spellings numpy would parse with a deprecation warning.
_DTYPE_RE: Final = re.compile(r"[<>|][biufcmMSUV][0-9]{1,10}(?:\[[0-9]{0,10}[A-Za-z]{1,7}\])?")
_HEADER_DECODER: Final = msgspec.msgpack.Decoder()
_HEADER_ENCODER: Final = msgspec.msgpack.Encoder()
_REMEMBERED_MAX: Final = 1024
"""Headers remembered each way at most; the memory is cleared when full."""

Layout = tuple["np.dtype[Any]", tuple[int, ...], int, int]
"""A checked header: dtype, shape, element count, data offset."""
_LAYOUTS: dict[bytes, Layout] = {}
_PREFIXES: dict[tuple[str, tuple[int, ...]], bytes] = {}


def payload(arr: npt.NDArray[Any]) -> bytes:
    """The ext payload of `arr`; `CodecError` for object, structured or empty dtypes."""
    import numpy as np

    dt = arr.dtype
    if dt.hasobject or dt.fields is not None or dt.itemsize == 0:
        raise CodecError(f"cannot encode numpy array of dtype {dt}: object/structured/empty")
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")  # the only extra copy, and only for strided input
    raw = arr.reshape(-1).view(np.uint8).data  # memoryview over arr, no tobytes()
    # An ext holds bytes, so joining prefix and buffer is the one unavoidable copy.
    return b"".join((_prefix(dt.str, arr.shape), raw))


def array(view: memoryview) -> Any:
    """A zero-copy, read-only array over one copy of the payload (``view`` points into a
    message at any offset: not aligned, and writable when the message was); every field
    checked, `CodecError` if one is wrong."""
    data = bytes(view)
    dt, shape, count, start = check(data)  # first: without numpy, a CodecError that says so
    import numpy as np

    flat = np.frombuffer(data, dtype=dt, count=count, offset=start)
    return flat if len(shape) == 1 else flat.reshape(shape)


def check(data: bytes | memoryview) -> Layout:
    """What `array` checks, without the copy and the array; `CodecError` if wrong."""
    if isinstance(data, memoryview):  # msgspec's view: its len runs past the payload,
        data = data[: data.nbytes]  # into the rest of the message; its nbytes does not
    try:
        import numpy  # noqa: F401
    except ImportError as e:
        raise CodecError("message carries a numpy array but numpy is not installed") from e
    try:
        (hlen,) = _HLEN.unpack_from(data)
    except struct.error as e:
        raise CodecError("array ext: truncated header") from e
    head = bytes(data[: _HLEN.size + hlen])
    layout = _LAYOUTS.get(head)
    if layout is None:
        layout = _layout(data, hlen)
        if len(_LAYOUTS) >= _REMEMBERED_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[head] = layout
    dt, _shape, count, start = layout
    if count * dt.itemsize != len(data) - start:
        raise CodecError("array ext: data length does not match dtype and shape")
    return layout


def _pad_to(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _prefix(dtype_str: str, shape: tuple[int, ...]) -> bytes:
    """The payload's bytes before the data: header length, `[dtype, shape]`, padding."""
    prefix = _PREFIXES.get((dtype_str, shape))
    if prefix is None:
        header = _HEADER_ENCODER.encode([dtype_str, list(shape)])
        start = _pad_to(_HLEN.size + len(header))
        prefix = _HLEN.pack(len(header)) + header + bytes(start - _HLEN.size - len(header))
        if len(_PREFIXES) >= _REMEMBERED_MAX:
            _PREFIXES.clear()
        _PREFIXES[(dtype_str, shape)] = prefix
    return prefix


def _layout(data: bytes | memoryview, hlen: int) -> Layout:
    import numpy as np

    start = _pad_to(_HLEN.size + hlen)
    if start > len(data):
        raise CodecError("array ext: truncated header")
    header = _HEADER_DECODER.decode(bytes(data[_HLEN.size : _HLEN.size + hlen]))
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
    try:
        dt: np.dtype[Any] = np.dtype(dtype_str)
    except (TypeError, ValueError) as e:  # well spelled, yet unknown ("<f3")
        raise CodecError(f"array ext: unknown dtype {dtype_str!r}") from e
    if dt.str != dtype_str or dt.itemsize == 0:
        raise CodecError(f"array ext: non-canonical dtype {dtype_str!r}")
    return dt, tuple(shape), math.prod(shape), start
