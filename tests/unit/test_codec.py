"""Rules of the wire codec (omni_runtime.wire.codec): msgpack round trips, zero-copy arrays,
and CodecError as the only failure on untrusted bytes."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from omni_runtime.errors import CodecError
from omni_runtime.wire import codec
from omni_runtime.wire.codec import (
    BATCH_HEADER_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_DEPTH,
    NDARRAY_EXT_CODE,
    batches,
    check,
    decode,
    decode_model,
    encode,
    encode_decoded,
    encode_model,
)

SETTINGS = settings(deadline=None, max_examples=200)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
    | st.binary()
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)


def same(a: Any, b: Any) -> bool:
    """Equality that also checks types (True is not 1) and treats NaN as equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@SETTINGS
@given(values)
def test_roundtrip_is_identity_for_supported_types(obj: Any) -> None:
    assert same(decode(encode(obj)), obj)


read_values = st.recursive(
    scalars
    | st.datetimes(timezones=st.just(UTC))
    | st.builds(np.array, st.lists(st.floats(allow_nan=False, width=32), max_size=6)),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(
            st.text(max_size=8) | st.integers(-5, 300) | st.binary(max_size=3), children, max_size=5
        )
    ),
    max_leaves=30,
)


@SETTINGS
@given(read_values)
def test_encode_decoded_gives_encodes_bytes_for_whatever_decode_returns(obj: Any) -> None:
    read = decode(encode(obj))
    assert encode_decoded(read) == encode(read)
    assert encode_decoded({"data": read, "seq": 1}) == encode({"data": read, "seq": 1})


def test_tuples_decode_as_lists() -> None:
    assert decode(encode((1, (2, "x"), [3]))) == [1, [2, "x"], [3]]


def test_bytes_like_travel_as_bin_and_decode_as_bytes() -> None:
    payload = bytes(range(256))
    for obj in (payload, bytearray(payload), memoryview(payload)):
        wire = encode(obj)
        assert payload in wire  # raw, not base64
        assert decode(wire) == payload


def test_int_and_bytes_dict_keys_roundtrip() -> None:
    obj = {1: "a", -2: "b", b"k": "c", "s": {b"\x00": 3}}
    assert decode(encode(obj)) == obj


def test_decode_accepts_bytearray_and_memoryview() -> None:
    wire = encode({"a": [1, 2.5, b"x"]})
    for buf in (wire, bytearray(wire), memoryview(wire)):
        assert decode(buf) == {"a": [1, 2.5, b"x"]}


ARRAYS = {
    "float32_pcm": np.sin(np.linspace(0, 6.28, 480, dtype=np.float32)),
    "int16_pcm": (np.arange(-1000, 1000, 7, dtype=np.int16)),
    "zero_d": np.array(3.5),
    "empty": np.zeros((0, 4), dtype=np.float64),
    "non_contiguous": np.arange(60, dtype=np.int32).reshape(6, 10)[::2, 1::3],
    "fortran": np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
    "big_endian": np.arange(5, dtype=">f8"),
    "bool": np.array([[True, False], [False, True]]),
    "uint8_3d": np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
    "complex": np.array([1 + 2j, -3.5j], dtype=np.complex128),
    "float16": np.array([0.5, -1.0], dtype=np.float16),
    "unicode": np.array(["ab", "cde"]),
    "datetime": np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[ns]"),
}


@pytest.mark.parametrize("arr", list(ARRAYS.values()), ids=list(ARRAYS))
def test_ndarray_roundtrip_keeps_dtype_shape_values(arr: np.ndarray[Any, Any]) -> None:
    out = decode(encode(arr))
    assert isinstance(out, np.ndarray)
    assert out.dtype == arr.dtype
    assert out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("arr", list(ARRAYS.values()), ids=list(ARRAYS))
def test_decoded_ndarray_is_zero_copy_readonly_and_aligned(arr: np.ndarray[Any, Any]) -> None:
    out = decode(encode({"data": arr}))["data"]
    assert not out.flags.owndata  # a view over the ext payload, not a copy
    assert out.base is not None
    assert not out.flags.writeable
    assert out.flags.aligned
    assert out.flags.c_contiguous


def test_array_payload_is_raw_c_order_bytes_not_base64() -> None:
    arr = np.arange(1000, dtype=np.float32)
    assert arr.tobytes() in encode(arr)
    assert np.ascontiguousarray(arr[::3]).tobytes() in encode(arr[::3])


def test_ndarray_nested_in_envelope_roundtrips() -> None:
    pcm = np.arange(16, dtype=np.float32)
    out = decode(encode({"req": "r1", "chunks": [pcm, pcm[::2]], "meta": {"sr": 24000}}))
    assert out["req"] == "r1" and out["meta"] == {"sr": 24000}
    np.testing.assert_array_equal(out["chunks"][0], pcm)
    np.testing.assert_array_equal(out["chunks"][1], pcm[::2])


def test_numpy_scalars_become_python_scalars() -> None:
    out = decode(encode([np.float32(1.5), np.int64(-7), np.bool_(True), np.uint8(255)]))
    assert out == [1.5, -7, True, 255]
    assert [type(x) for x in out] == [float, int, bool, int]


@SETTINGS
@given(st.binary(max_size=2048))
def test_random_bytes_decode_or_raise_only_codec_error(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        decode(data)


@SETTINGS
@given(st.binary(max_size=256))
def test_random_array_ext_payload_decodes_or_raises_only_codec_error(payload: bytes) -> None:
    with contextlib.suppress(CodecError):
        decode(msgpack.packb(msgpack.ExtType(NDARRAY_EXT_CODE, payload)))


def test_oversize_input_raises_codec_error() -> None:
    wire = encode(b"x" * 1000)
    with pytest.raises(CodecError, match="exceeds"):
        decode(wire, max_bytes=100)
    with pytest.raises(CodecError, match="exceeds"):
        decode(memoryview(wire), max_bytes=100)
    assert decode(wire, max_bytes=None) == b"x" * 1000
    assert DEFAULT_MAX_MESSAGE_BYTES == 64 * 1024 * 1024


@pytest.mark.parametrize(
    "obj",
    [object(), {1, 2}, frozenset(), 1j, {"k": [object()]}],
    ids=["object", "set", "frozenset", "complex", "nested-object"],  # the same in every process
)
def test_unsupported_type_raises_codec_error_naming_it(obj: Any) -> None:
    with pytest.raises(CodecError, match="cannot encode"):
        encode(obj)


def test_unsupported_type_message_names_the_type() -> None:
    with pytest.raises(CodecError, match=r"builtins\.set"):
        encode({"a": {1}})


def test_int_out_of_msgpack_range_raises_codec_error() -> None:
    with pytest.raises(CodecError):
        encode(2**64)
    with pytest.raises(CodecError):
        encode(-(2**63) - 1)


def test_object_dtype_array_raises_codec_error() -> None:
    with pytest.raises(CodecError, match="dtype"):
        encode(np.array([1, "a", None], dtype=object))


def test_structured_dtype_array_raises_codec_error() -> None:
    with pytest.raises(CodecError, match="dtype"):
        encode(np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]))


def test_unknown_ext_code_raises_codec_error() -> None:
    with pytest.raises(CodecError, match="ext type 42"):
        decode(msgpack.packb(msgpack.ExtType(42, b"abc")))


def test_a_failed_encode_leaves_the_next_one_whole() -> None:
    """The thread's packer is dropped when a value fails midway through a map."""
    with pytest.raises(CodecError):
        encode({"a": "x" * 100, "b": {1, 2}})
    value = {"c": [1, 2, 3], "d": b"\x00" * 10}
    assert encode(value) == msgpack.packb(value, use_bin_type=True)


def test_a_packer_grown_by_a_big_message_is_not_kept() -> None:
    from omni_runtime.wire import codec

    encode({"small": 1})
    assert codec._PACKERS.packer is not None
    encode(b"\x00" * (codec._PACKER_KEEP_BYTES + 1))
    assert codec._PACKERS.packer is None  # its megabytes go with it
    assert encode({"small": 1}) == msgpack.packb({"small": 1})


def test_threads_encoding_at_once_each_get_their_own_bytes() -> None:
    import threading

    values = [{"i": i, "data": np.arange(i % 7, dtype=np.int32), "s": "x" * i} for i in range(64)]
    expected = [encode(v) for v in values]
    wrong: list[int] = []

    def work() -> None:
        for _ in range(20):
            wrong.extend(i for i, v in enumerate(values) if encode(v) != expected[i])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not wrong and not any(t.is_alive() for t in threads)


def _array_ext(header: Any, raw: bytes, pad: bool = True) -> bytes:
    h = msgpack.packb(header)
    prefix = len(h).to_bytes(2, "little") + h
    if pad:
        prefix += bytes(-len(prefix) % 16)
    return bytes(msgpack.packb(msgpack.ExtType(NDARRAY_EXT_CODE, prefix + raw)))


@pytest.mark.parametrize(
    "wire",
    [
        _array_ext(["|O8", [1]], bytes(8)),  # object dtype
        _array_ext(["<f4", [3]], bytes(8)),  # length mismatch
        _array_ext(["|f4", [2]], bytes(8)),  # non-canonical spelling
        _array_ext(["<f4", [-1]], bytes(8)),  # negative dimension
        _array_ext(["<f4", [True, 2]], bytes(8)),  # bool is not a dimension
        _array_ext(["<f4"], bytes(8)),  # header too short
        _array_ext({"dtype": "<f4"}, bytes(8)),  # header not a list
        _array_ext(["<i4,<f8", [1]], bytes(12)),  # structured dtype spec
        _array_ext(["<f3", [2]], bytes(6)),  # dtype numpy does not know
        _array_ext(["|S0", [0]], b""),  # zero itemsize
        bytes(msgpack.packb(msgpack.ExtType(NDARRAY_EXT_CODE, b"\xff\xff\x00"))),  # truncated
    ],
)
def test_bad_array_ext_header_raises_codec_error(wire: bytes) -> None:
    with pytest.raises(CodecError):
        decode(wire)


def test_a_header_checked_before_still_has_its_payload_checked() -> None:
    """Headers are checked once and remembered: the payload's length never is."""
    good = _array_ext(["<f4", [2]], bytes(8))
    assert decode(good).shape == (2,)
    for raw in (bytes(4), bytes(12), b""):  # the same header, a payload of the wrong size
        with pytest.raises(CodecError, match="length"):
            decode(_array_ext(["<f4", [2]], raw))
    with pytest.raises(CodecError):  # the same header bytes, cut short
        decode(bytes(msgpack.packb(msgpack.ExtType(NDARRAY_EXT_CODE, _array_prefix(good)[:5]))))
    assert decode(good).tolist() == [0.0, 0.0]


def test_an_array_header_running_past_its_payload_is_refused() -> None:
    """A payload claiming a header longer than itself, followed in the message by what a
    header and data could be read from (msgspec hands the hook a view whose len runs on
    into the message): refused whether decoded or only checked, whatever follows."""
    header = ["<f4", [1]]
    ext = msgpack.ExtType(NDARRAY_EXT_CODE, len(msgpack.packb(header)).to_bytes(2, "little"))
    for zeros in range(40):
        wire = bytes(msgpack.packb([ext, header, *[0] * zeros]))
        with pytest.raises(CodecError):
            decode(wire)
        with pytest.raises(CodecError):
            check(wire)


def _array_prefix(wire: bytes) -> bytes:
    ext = msgpack.unpackb(wire, ext_hook=lambda code, data: data)
    return bytes(ext)


@pytest.mark.parametrize(
    "wire",
    [b"", b"\xc1", b"\x92\x01", b"\x01\x02", b"\xa3ab", b"\xa2\xff\xfe"],
    ids=["empty", "never_used", "truncated", "extra_data", "short_str", "bad_utf8"],
)
def test_malformed_bytes_raise_exactly_codec_error(wire: bytes) -> None:
    with pytest.raises(CodecError):
        decode(wire)


def test_array_map_key_decodes_as_a_tuple_and_encodes_back() -> None:
    wire = b"\x81\x92\x01\x02\xa1x"  # {[1, 2]: "x"}: valid msgpack, a key Python can hash
    assert decode(wire) == {(1, 2): "x"}
    assert encode(decode(wire)) == wire


def test_timestamps_decode_as_utc_datetimes_and_encode_back() -> None:
    wire = bytes(msgpack.packb(msgpack.Timestamp(1_700_000_000, 5000)))
    out = decode(wire)
    assert out == datetime(2023, 11, 14, 22, 13, 20, 5, tzinfo=UTC)
    assert encode(out) == wire
    with pytest.raises(CodecError, match="datetime"):
        encode(datetime(2023, 11, 14))  # naive: no instant to send


def test_codec_error_chains_the_cause() -> None:
    with pytest.raises(CodecError) as info:
        decode(b"\x01\x02")
    assert info.value.__cause__ is not None


class Chunk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str
    seq: int
    data: bytes
    tags: list[str] = []


def test_decode_model_roundtrips_model_with_bytes() -> None:
    chunk = Chunk(request_id="r1", seq=3, data=b"\x00\xffpcm", tags=["a"])
    wire = encode_model(chunk)
    assert b"\x00\xffpcm" in wire
    assert decode_model(wire, Chunk) == chunk


def test_decode_model_wrong_shape_raises_codec_error_naming_model_and_field() -> None:
    wire = encode({"request_id": "r1", "seq": "not-an-int", "data": b""})
    with pytest.raises(CodecError, match=r"Chunk: seq: .*integer"):
        decode_model(wire, Chunk)


def test_decode_model_extra_field_raises_codec_error() -> None:
    wire = encode({"request_id": "r1", "seq": 1, "data": b"", "evil": 1})
    with pytest.raises(CodecError, match="evil"):
        decode_model(wire, Chunk)


@pytest.mark.parametrize("wire", [b"\xc1\x00", encode(5), encode([1, 2])], ids=repr)
def test_decode_model_garbage_raises_codec_error(wire: bytes) -> None:
    with pytest.raises(CodecError):
        decode_model(wire, Chunk)


def test_module_imports_and_works_without_numpy() -> None:
    arr_wire = encode(np.arange(3, dtype=np.int16))
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["numpy"] = None  # make `import numpy` fail
        from omni_runtime.wire.codec import decode, encode
        from omni_runtime.errors import CodecError
        assert decode(encode({{"a": [1, b"x"]}})) == {{"a": [1, b"x"]}}
        try:
            decode({arr_wire!r})
        except CodecError as e:
            assert "numpy" in str(e), e
        else:
            raise AssertionError("array decoded without numpy")
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


def _nest(depth: int) -> Any:
    out: Any = 0
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize("enc", [encode, encode_decoded], ids=["encode", "encode_decoded"])
def test_nesting_is_bounded_the_same_both_ways(enc: Any) -> None:
    """MAX_DEPTH levels of lists and maps (a message's map is one) travel; one more is a
    CodecError when written, and when read (a hostile writer's bytes), before any recursion
    limit could be met; an array at the root (a batch) is free."""
    ok = {"data": _nest(MAX_DEPTH - 1)}
    assert decode(enc(ok)) == ok
    assert decode(enc([ok, ok])) == [ok, ok]
    deep = {"data": _nest(MAX_DEPTH)}
    with pytest.raises(CodecError, match=f"nested deeper than {MAX_DEPTH} levels"):
        enc(deep)
    with pytest.raises(CodecError, match="nested deeper"):
        enc({"k": {"k": deep}})
    with pytest.raises(CodecError, match="nested deeper"):
        decode(msgpack.packb(deep))
    for depth in (1_000, 200_000):  # msgspec alone: a bare RecursionError near 1,000
        with pytest.raises(CodecError, match="nested deeper"):
            decode(b"\x91" * depth + b"\x00")
        with pytest.raises(CodecError, match="nested deeper"):
            check(b"\x91" * depth + b"\x00")


@SETTINGS
@given(read_values, st.integers(0, 8))
def test_the_header_byte_bound_never_passes_what_the_walk_refuses(obj: Any, depth: int) -> None:
    """Small messages skip the walk of their decoded value when their bytes prove them
    shallow: that proof must hold whatever the values' own bytes look like."""
    raw = encode(obj)
    if codec.shallow(raw, depth):
        assert codec.within(decode(raw), depth)


def test_header_like_bytes_inside_values_still_read() -> None:
    """Bytes that look like list and map headers (inside a bin, an int) only send a
    message to the walk, which passes it."""
    msg = {"data": {"pcm": b"\x9f\x8f\xde" * 100, "n": [0x9F] * 40}, "finished": False}
    raw = encode(msg)
    assert not codec.shallow(raw, MAX_DEPTH)
    assert decode(raw) == msg
    check(raw)


def test_nesting_through_map_keys_counts_too() -> None:
    key: Any = 0
    for _ in range(MAX_DEPTH + 2):
        key = (key,)
    raw = msgpack.packb({key: 1})
    with pytest.raises(CodecError, match="nested deeper"):
        decode(raw)


def test_check_bounds_relayed_data_by_what_is_left_of_the_depth() -> None:
    raw = encode(_nest(10))
    check(raw, max_depth=10)
    with pytest.raises(CodecError, match="nested deeper than 9"):
        check(raw, max_depth=9)


def test_batches_keep_each_units_items_whole_and_in_order() -> None:
    """A unit (a request) goes whole into one batch where it fits, gathered where its
    first item was; one too big for any batch fills several of its own."""
    items = [("a", 4), ("b", 4), ("a", 4), ("c", 30), ("b", 4), ("c", 30)]
    size = lambda item: item[1]  # noqa: E731
    limit = 20 + BATCH_HEADER_BYTES
    assert batches(items, size, limit) == [items[:3], items[3:4], items[4:5], items[5:]]
    assert batches(items, size, limit, unit=lambda item: item[0]) == [
        [("a", 4), ("a", 4), ("b", 4), ("b", 4)],
        [("c", 30)],
        [("c", 30)],
    ]
