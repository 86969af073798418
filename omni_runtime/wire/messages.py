"""Typed wire messages: every stream entry is one of these, msgpack-encoded, validated on read.

Each model forbids extra fields and carries its `type` and a version `v`, so a
reader can reject a message from an incompatible peer with a clear error
instead of misreading it.

Every field is bounded, because anyone who may write to the streams can send any
value: a number is finite and in range (so no later arithmetic overflows: a
deadline becomes a `PEXPIREAT` in milliseconds), a string, list or map has a
maximum length, and the codec bounds how deep a message nests
(`codec.MAX_DEPTH`). The models are strict: a value of the wrong type is
refused, never coerced (`finished=1` is not `True`, `"5"` is not 5). These
bounds are part of the wire format, the same in every process (a reader that
refused what a writer accepted would dead-letter it): they are constants, not
settings. What a deployer sets is policy, checked where a request comes in
(`Settings.max_deadline_s`).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from omni_runtime.core.types import MAX_PARAM_STR_CHARS as MAX_PARAM_STR_CHARS
from omni_runtime.core.types import MAX_TOKEN_COUNT as MAX_TOKEN_COUNT
from omni_runtime.core.types import FinishReason
from omni_runtime.errors import ERROR_CODE_PATTERN, CodecError
from omni_runtime.keys import MAX_SLOTS as MAX_SLOTS

WIRE_VERSION: Final = 1
REDIS_LOST_STATE: Final = "Redis restarted and lost this request's state"
"""The error final of a request in flight when Redis came back empty."""

MAX_DEADLINE_S: Final = 366 * 86400.0
"""The longest deadline a request may carry (a year): `OMNI_MAX_DEADLINE_S` is at most this."""
MAX_WALL_CLOCK_S: Final = 10_000_000_000.0
"""The latest wall-clock time (s since the epoch, year 2286) a durable state's deadline may
name: its expiry in ms stays far inside Redis's range."""
MAX_STAGES: Final = 256
"""Stage ids are 0 .. MAX_STAGES - 1 (`pipeline.PipelineConfig` allows no more)."""
MAX_SEQ: Final = 2**32 - 1
"""Outputs of one request at one stage (and to its client): per-request counters."""
MAX_REASON_CHARS: Final = 1000
MAX_ERROR_CHARS: Final = 4000
"""An error longer than this is cut (`clip_error`) by whoever writes it."""
MAX_PARAMS: Final = 32
MAX_PARAM_KEY_CHARS: Final = 64
MAX_PARAM_LIST: Final = 256
INT_MIN: Final = -(2**63)
INT_MAX: Final = 2**63 - 1
"""A parameter's integers: int64 (msgpack carries up to 2**64 - 1; msgspec bounds int64)."""
FLOAT_MAX: Final = 1.7976931348623157e308
"""The largest finite float: bounds written with it refuse `inf` and `nan`."""

RequestId = Annotated[
    str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$", strict=True)
]
"""Strict: an id sent as bytes (or a number) is refused, never coerced into another id.
No control characters: ids go into logs and key names."""
ClientId = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$", strict=True)
]
StageId = Annotated[int, Field(ge=0, lt=MAX_STAGES)]
Seq = Annotated[int, Field(ge=0, le=MAX_SEQ)]
Slot = Annotated[int, Field(ge=0, lt=MAX_SLOTS)]
DeadlineS = Annotated[float, Field(gt=0, le=MAX_DEADLINE_S, allow_inf_nan=False)]
WallClock = Annotated[float, Field(ge=0, le=MAX_WALL_CLOCK_S, allow_inf_nan=False)]
Reason = Annotated[str, Field(min_length=1, max_length=MAX_REASON_CHARS)]
Error = Annotated[str, Field(min_length=1, max_length=MAX_ERROR_CHARS)]
"""Non-empty: an empty error would read as no error."""
TokenCount = Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)]
"""A model's token count (`core.types.TokenUsage`)."""
ErrorCode = Annotated[str, Field(pattern=ERROR_CODE_PATTERN, strict=True)]
"""Set beside `error` when the request itself was at fault (`stage_api.RequestRefused`):
OpenAI's kind of code (`context_length_exceeded`), which the front door answers with a
400 instead of a 502."""


def _not_an_int(value: object) -> object:
    """A float parameter is a float: an int out of the int range is refused, not widened."""
    if type(value) is int:
        raise ValueError(f"integer out of range {INT_MIN} .. {INT_MAX}")
    return value


ParamScalar = (
    None
    | bool
    | Annotated[int, Field(ge=INT_MIN, le=INT_MAX)]
    | Annotated[float, BeforeValidator(_not_an_int), Field(ge=-FLOAT_MAX, le=FLOAT_MAX)]
    | Annotated[str, Field(max_length=MAX_PARAM_STR_CHARS)]
)
Params = Annotated[
    dict[
        Annotated[str, Field(min_length=1, max_length=MAX_PARAM_KEY_CHARS)],
        ParamScalar | Annotated[list[ParamScalar], Field(max_length=MAX_PARAM_LIST)],
    ],
    Field(max_length=MAX_PARAMS),
]
"""Per-request parameters: JSON-like scalars, or short lists of them, under short names."""


def clip_error(error: str) -> str:
    """`error` cut to what a message may carry (`MAX_ERROR_CHARS`), its cut marked."""
    return error if len(error) <= MAX_ERROR_CHARS else error[: MAX_ERROR_CHARS - 1] + "…"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    v: Annotated[int, Field(ge=WIRE_VERSION, le=WIRE_VERSION)] = WIRE_VERSION
    """An int (`Literal[1]` would take `True` and `1.0` for 1)."""


class RequestMsg(_Wire):
    """Client → orchestrator, on the requests stream."""

    type: Literal["request"] = "request"
    request_id: RequestId
    client_id: ClientId
    prompt: Any
    deadline_s: DeadlineS | None = None
    trace: bool = False
    """Trace this request (every process stamps it into Redis) even with tracing off."""
    params: Params | None = None
    """Per-request parameters (`max_tokens`, `voice`, ...): every stage gets them all and
    takes the ones it knows."""


class AbortMsg(_Wire):
    """Client → orchestrator (requests stream) and orchestrator → workers (control stream)."""

    type: Literal["abort"] = "abort"
    request_id: RequestId
    reason: Reason = "aborted"


class StageInputMsg(_Wire):
    """Orchestrator → a stage's workers. `streaming`: the input arrives as chunks instead."""

    type: Literal["stage_input"] = "stage_input"
    request_id: RequestId
    trace: bool = False
    """The request is traced on demand: the worker stamps it too."""
    data: Any
    streaming: bool = False
    owner: Slot = 0
    """The orchestrator slot that owns the request: its outputs go to that slot's stream."""
    params: Params | None = None
    """The request's parameters (`RequestMsg.params`)."""


class StageOutputMsg(_Wire):
    """A stage's worker → orchestrator. `error` set: the stage failed this request."""

    type: Literal["stage_output"] = "stage_output"
    request_id: RequestId
    data: Any
    finished: bool
    error: Error | None = None
    seq: Seq = 0
    """Index of this output within the request at this stage: a replica that re-runs a
    request taken over from a dead one repeats seqs the orchestrator already has."""
    error_code: ErrorCode | None = None
    finish_reason: FinishReason | None = None
    """On a finished output: why the stage ended it (`stage_api.Final.finish_reason`)."""
    prompt_tokens: TokenCount | None = None
    completion_tokens: TokenCount | None = None
    """On a finished output: the model's token counts, when its engine gave them
    (`stage_api.Final.usage`)."""
    cached_tokens: TokenCount | None = None
    """Of `prompt_tokens`, those its engine's prompt cache held."""


class OrchOutputMsg(_Wire):
    """Orchestrator → the client that submitted the request."""

    type: Literal["orch_output"] = "orch_output"
    request_id: RequestId
    stage_id: StageId
    data: Any
    finished: bool
    error: Error | None = None
    seq: Seq
    """0, 1, 2, ... per request, assigned by the orchestrator as it emits: the client drops
    repeats and turns a gap into an error instead of a success that misses data."""
    error_code: ErrorCode | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: TokenCount | None = None
    completion_tokens: TokenCount | None = None
    cached_tokens: TokenCount | None = None


class DurableRequest(_Wire):
    """A request's routing state as its owner keeps it in Redis, so another can finish it.

    The stage data `forward_fn` will still need (sequential mode, stages not yet
    finished) is kept beside it, one hash field per chunk, written once each:
    `stage_chunks` says how many there are per stage (`orchestrator/request_store.py`).
    `stage_data` holds it inline, as states were written before. `stage_seq` is, per
    stage, the next output seq not yet handled; `out_seq` the seq of the client's next
    output; `deadline_at` a wall-clock time.
    """

    type: Literal["request_state"] = "request_state"
    request_id: RequestId
    client_id: ClientId
    prompt: Any
    deadline_at: WallClock | None
    submitted: Annotated[list[StageId], Field(max_length=MAX_STAGES)]
    finished: Annotated[list[StageId], Field(max_length=MAX_STAGES)]
    stage_data: Annotated[dict[StageId, list[Any]], Field(max_length=MAX_STAGES)] = Field(
        default_factory=dict
    )
    stage_chunks: Annotated[dict[StageId, Seq], Field(max_length=MAX_STAGES)] = Field(
        default_factory=dict
    )
    """Per stage, how many chunks of its data the store keeps beside the state (fields of
    their own, written once each: `orchestrator/request_store.py`)."""
    stage_seq: Annotated[dict[StageId, Seq], Field(max_length=MAX_STAGES)] = Field(
        default_factory=dict
    )
    out_seq: Seq = 0
    params: Params | None = None


def checked_request(**fields: Any) -> RequestMsg:
    """A `RequestMsg`, or a `CodecError` naming the first bad field (what a reader would
    have refused: the submitter hears it at once, not as a dead letter)."""
    try:
        return RequestMsg(**fields)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        loc = ".".join(str(part) for part in errors[0]["loc"]) if errors else "<root>"
        first = errors[0]["msg"] if errors else str(e)
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise CodecError(f"invalid request: {loc}: {first}{more}") from None


ClientCommand = Annotated[RequestMsg | AbortMsg, Field(discriminator="type")]
"""What may appear on the requests stream."""
