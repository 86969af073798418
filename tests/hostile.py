"""Hypothesis strategies for every wire message: valid ones, and hostile ones (valid but
for one to three fields: inf, nan, huge, negative, empty, wrong-typed, too long, too
deep, missing, extra). The schema's property tests (`tests/unit/test_wire_schema.py`)
and the hostile-requests fault scenario (`tests/faults/test_hostile_requests.py`) draw
from them."""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

import hypothesis
import msgpack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from omni_runtime.wire import messages as m
from omni_runtime.wire.codec import MAX_DEPTH

KINDS = ("request", "abort", "stage_input", "stage_output", "orch_output", "request_state")

INF, NAN = float("inf"), float("nan")


@dataclass(frozen=True)
class Deep:
    """Stands for `depth` nested lists (around a 0) in a doc: `raw` packs them as such
    (past msgpack's own nesting limit, as a hostile writer may); `materialized` builds them."""

    depth: int


def too_deep() -> st.SearchStrategy[Any]:
    """Past what a message's free-form field may nest (the message's map is one level)."""
    return st.sampled_from([MAX_DEPTH, MAX_DEPTH + 7, 200, 1000, 100_000]).map(Deep)


def raw(doc: Any) -> bytes:
    """`doc` packed as msgpack the way any writer could, with no check of ours."""
    marks: dict[bytes, bytes] = {}

    def mark(obj: object) -> Any:
        if not isinstance(obj, Deep):
            raise TypeError(f"cannot pack {type(obj).__name__}")
        token = f"\x00deep-{obj.depth}-{len(marks)}\x00"
        marks[msgpack.packb(token)] = b"\x91" * obj.depth + b"\x00"
        return token

    out: bytes = msgpack.packb(doc, use_bin_type=True, default=mark)
    for token, deep in marks.items():
        out = out.replace(token, deep)
    return out


def materialized(doc: Any) -> Any:
    """`doc` with each `Deep` built (for a client that is handed such a value)."""
    if isinstance(doc, Deep):
        out: Any = 0
        for _ in range(doc.depth):
            out = [out]
        return out
    if isinstance(doc, dict):
        return {k: materialized(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [materialized(v) for v in doc]
    return doc


# --- valid values --------------------------------------------------------------------

ids = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], min_codepoint=0x20).filter(
        lambda c: c != "\x7f"
    ),
    min_size=1,
    max_size=40,
)
client_ids = st.text(alphabet=string.ascii_letters + string.digits + "_.-", min_size=1, max_size=40)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(m.INT_MIN, m.INT_MAX),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
payloads = st.recursive(
    json_scalars | st.binary(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=12,
)
param_keys = st.text(min_size=1, max_size=m.MAX_PARAM_KEY_CHARS)
params = (
    st.dictionaries(param_keys, json_scalars | st.lists(json_scalars, max_size=5), max_size=6)
    | st.none()
)
deadlines = st.floats(min_value=1e-3, max_value=m.MAX_DEADLINE_S) | st.integers(1, 3600)
seqs = st.integers(0, m.MAX_SEQ)
stage_ids = st.integers(0, m.MAX_STAGES - 1)
errors = st.text(min_size=1, max_size=60)
error_codes = st.from_regex(r"\A[a-z][a-z0-9_]{0,63}\Z") | st.none()
finish_reasons = st.sampled_from(["stop", "length", None])
token_counts = st.integers(0, m.MAX_TOKEN_COUNT) | st.none()

VALID: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "request": {
        "request_id": ids,
        "client_id": client_ids,
        "prompt": payloads,
        "deadline_s": deadlines | st.none(),
        "trace": st.booleans(),
        "params": params,
    },
    "abort": {"request_id": ids, "reason": st.text(min_size=1, max_size=40)},
    "stage_input": {
        "request_id": ids,
        "trace": st.booleans(),
        "data": payloads,
        "streaming": st.booleans(),
        "owner": st.integers(0, m.MAX_SLOTS - 1),
        "params": params,
    },
    "stage_output": {
        "request_id": ids,
        "data": payloads,
        "finished": st.booleans(),
        "error": errors | st.none(),
        "seq": seqs,
        "error_code": error_codes,
        "finish_reason": finish_reasons,
        "prompt_tokens": token_counts,
        "completion_tokens": token_counts,
    },
    "orch_output": {
        "request_id": ids,
        "stage_id": stage_ids,
        "data": payloads,
        "finished": st.booleans(),
        "error": errors | st.none(),
        "seq": seqs,
        "error_code": error_codes,
        "finish_reason": finish_reasons,
        "prompt_tokens": token_counts,
        "completion_tokens": token_counts,
    },
    "request_state": {
        "request_id": ids,
        "client_id": client_ids,
        "prompt": payloads,
        "deadline_at": st.floats(0, m.MAX_WALL_CLOCK_S) | st.none(),
        "submitted": st.lists(stage_ids, max_size=4),
        "finished": st.lists(stage_ids, max_size=4),
        "stage_data": st.dictionaries(stage_ids, st.lists(payloads, max_size=3), max_size=3),
        "stage_seq": st.dictionaries(stage_ids, seqs, max_size=3),
        "out_seq": seqs,
        "params": params,
    },
}
REQUIRED: dict[str, set[str]] = {
    "request": {"request_id", "client_id", "prompt"},
    "abort": {"request_id"},
    "stage_input": {"request_id", "data"},
    "stage_output": {"request_id", "data", "finished"},
    "orch_output": {"request_id", "stage_id", "data", "finished", "seq"},
    "request_state": {"request_id", "client_id", "prompt", "deadline_at", "submitted", "finished"},
}


@st.composite
def valid_docs(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    """A message of `kind` its model accepts: required fields, some optional ones."""
    doc: dict[str, Any] = {"type": kind}
    if draw(st.booleans()):
        doc["v"] = 1
    for name, values in VALID[kind].items():
        if name in REQUIRED[kind] or draw(st.booleans()):
            doc[name] = draw(values)
    return doc


# --- hostile values ------------------------------------------------------------------

WRONG_TYPES = st.sampled_from([b"x", "5", [], {}, [1], {"a": 1}, None, 1.5, True])
HUGE_NUMBERS = st.sampled_from(
    [INF, -INF, NAN, 1e308, -1e308, 2**63, 2**64 - 1, -(2**63), m.MAX_DEADLINE_S * 1.001]
)


def bad_int(low: int, high: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from([low - 1, high + 1, -1, 2**63, 2**64 - 1, 1.0, True, "1", INF, NAN]),
        st.integers(min_value=-(2**63), max_value=low - 1),
        st.integers(min_value=high + 1, max_value=2**64 - 1),
    )


def bad_text(low: int, high: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from([b"id", 5, 1.5, True, ["a"], {"a": "b"}] + ([""] if low else [])),
        st.just("x" * (high + 1)),
        st.just("y" * (high + 1000)),
    )


bad_ids = bad_text(1, 256) | st.sampled_from(["a\nb", "\x00", "r\x7f", "\t", None])
bad_client_ids = bad_text(1, 128) | st.sampled_from(["a b", "c\n", "é", "x/y", "{c}", None])
bad_bools: st.SearchStrategy[Any] = st.sampled_from([1, 0, "true", "false", None, 1.0, b"\x01", []])
bad_deadlines = st.one_of(
    HUGE_NUMBERS,
    st.sampled_from([0, 0.0, -0.0, -1, -1e-9, "5", True, False, [], {}, b"1"]),
    st.floats(max_value=0.0),
    st.floats(min_value=m.MAX_DEADLINE_S, exclude_min=True),
)
bad_param_values = st.one_of(
    st.sampled_from([INF, -INF, NAN, 2**63, 2**64 - 1, b"raw", {"a": 1}, [[1]], [INF], [{}]]),
    st.just("v" * (m.MAX_PARAM_STR_CHARS + 1)),
    st.just(list(range(m.MAX_PARAM_LIST + 1))),
)
bad_params = st.one_of(
    st.sampled_from(["x", 5, [], [("a", 1)], b"params", True]),
    bad_param_values.map(lambda v: {"ok": 1, "bad": v}),
    st.sampled_from(["", "k" * (m.MAX_PARAM_KEY_CHARS + 1)]).map(lambda k: {k: 1}),
    st.just({f"k{i}": i for i in range(m.MAX_PARAMS + 1)}),
    st.just({1: "int key"}),
)
bad_errors = bad_text(1, m.MAX_ERROR_CHARS)
bad_error_codes = st.sampled_from(["", "Bad Code", "9lives", "a-b", "x" * 65, 5, True, b"code"])
bad_finish_reasons = st.sampled_from(["", "STOP", "eos", "length\n", 1, True, b"stop", ["stop"]])

HOSTILE: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "request": {
        "v": st.sampled_from([True, 1.0, 2, 0, "1", None]),
        "request_id": bad_ids,
        "client_id": bad_client_ids,
        "prompt": too_deep(),
        "deadline_s": bad_deadlines,
        "trace": bad_bools,
        "params": bad_params,
    },
    "abort": {"request_id": bad_ids, "reason": bad_text(1, m.MAX_REASON_CHARS) | st.none()},
    "stage_input": {
        "request_id": bad_ids,
        "trace": bad_bools,
        "data": too_deep(),
        "streaming": bad_bools,
        "owner": bad_int(0, m.MAX_SLOTS - 1),
        "params": bad_params,
    },
    "stage_output": {
        "request_id": bad_ids,
        "data": too_deep(),
        "finished": bad_bools,
        "error": bad_errors,
        "seq": bad_int(0, m.MAX_SEQ),
        "error_code": bad_error_codes,
        "finish_reason": bad_finish_reasons,
        "prompt_tokens": bad_int(0, m.MAX_TOKEN_COUNT),
        "completion_tokens": bad_int(0, m.MAX_TOKEN_COUNT),
    },
    "orch_output": {
        "request_id": bad_ids,
        "stage_id": bad_int(0, m.MAX_STAGES - 1),
        "data": too_deep(),
        "finished": bad_bools,
        "error": bad_errors,
        "seq": bad_int(0, m.MAX_SEQ),
        "error_code": bad_error_codes,
        "finish_reason": bad_finish_reasons,
        "prompt_tokens": bad_int(0, m.MAX_TOKEN_COUNT),
        "completion_tokens": bad_int(0, m.MAX_TOKEN_COUNT),
    },
    "request_state": {
        "request_id": bad_ids,
        "client_id": bad_client_ids,
        "prompt": too_deep(),
        "deadline_at": st.one_of(
            HUGE_NUMBERS.filter(lambda x: not 0 <= x <= m.MAX_WALL_CLOCK_S),  # 1971 is a time
            st.sampled_from([-1.0, m.MAX_WALL_CLOCK_S * 2, "now", True]),
        ),
        "submitted": st.one_of(
            st.sampled_from([[-1], [m.MAX_STAGES], [True], "0", None, [0.0], {0: 1}]),
            st.just([*range(m.MAX_STAGES), 0]),
        ),
        "finished": st.sampled_from([[-1], [m.MAX_STAGES], [True], "0", None]),
        "stage_data": st.sampled_from([{-1: []}, {"0": []}, {0: "x"}, {True: []}, []]),
        "stage_seq": st.sampled_from([{0: -1}, {0: m.MAX_SEQ + 1}, {"0": 1}, {0: 1.0}]),
        "out_seq": bad_int(0, m.MAX_SEQ),
        "params": bad_params,
    },
}


@st.composite
def hostile_docs(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    """A message of `kind` its model refuses: a valid one with one to three fields made
    hostile (a value, or the field missing, or one too many)."""
    doc = draw(valid_docs(kind))
    names = sorted(HOSTILE[kind])
    spoilt = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    for name in spoilt:
        how = draw(st.integers(0, 9))
        if how == 0 and name in REQUIRED[kind]:
            doc.pop(name, None)
        elif how == 1:
            doc["unknown_field"] = draw(json_scalars)
        else:
            doc[name] = draw(HOSTILE[kind][name])
    return doc


def any_docs(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    """Valid, hostile, or fields of any value at all."""
    anything = st.fixed_dictionaries(
        {"type": st.just(kind)},
        optional={n: json_scalars | payloads for n in [*VALID[kind], "v", "other"]},
    )
    return st.one_of(valid_docs(kind), hostile_docs(kind), anything)


def draw_many(strategy: st.SearchStrategy[Any], n: int, seed: int = 0) -> list[Any]:
    """`n` values of `strategy` as hypothesis's own engine generates them (one `given` run
    that keeps what it is handed, no shrinking), for a load rather than a property: the
    same values as the property tests meet, in bulk. Repeated if it stopped short."""
    out: list[Any] = []

    @settings(
        max_examples=n,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value: Any) -> None:
        out.append(value)

    hypothesis.seed(seed)(collect)()
    while out and len(out) < n:
        out.extend(out[: n - len(out)])
    return out
