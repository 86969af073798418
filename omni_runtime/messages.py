"""Typed wire messages: every stream entry is one of these, msgpack-encoded, validated on read.

Each model forbids extra fields and carries its `type` and a version `v`, so a
reader can reject a message from an incompatible peer with a clear error
instead of misreading it.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

WIRE_VERSION: Final = 1
REDIS_LOST_STATE: Final = "Redis restarted and lost this request's state"
"""The error final of a request in flight when Redis came back empty."""

RequestId = Annotated[str, Field(min_length=1, max_length=256, strict=True)]
"""Strict: an id sent as bytes (or a number) is refused, never coerced into another id."""
ClientId = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$", strict=True)
]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    v: Literal[1] = WIRE_VERSION


class RequestMsg(_Wire):
    """Client → orchestrator, on the requests stream."""

    type: Literal["request"] = "request"
    request_id: RequestId
    client_id: ClientId
    prompt: Any
    deadline_s: Annotated[float, Field(gt=0)] | None = None
    trace: bool = False
    """Trace this request (every process stamps it into Redis) even with tracing off."""
    params: dict[str, Any] | None = None
    """Per-request parameters (`max_tokens`, `voice`, ...): every stage gets them all and
    takes the ones it knows."""


class AbortMsg(_Wire):
    """Client → orchestrator (requests stream) and orchestrator → workers (control stream)."""

    type: Literal["abort"] = "abort"
    request_id: RequestId
    reason: str = "aborted"


class StageInputMsg(_Wire):
    """Orchestrator → a stage's workers. `streaming`: the input arrives as chunks instead."""

    type: Literal["stage_input"] = "stage_input"
    request_id: RequestId
    trace: bool = False
    """The request is traced on demand: the worker stamps it too."""
    data: Any
    streaming: bool = False
    owner: Annotated[int, Field(ge=0)] = 0
    """The orchestrator slot that owns the request: its outputs go to that slot's stream."""
    params: dict[str, Any] | None = None
    """The request's parameters (`RequestMsg.params`)."""


class StageOutputMsg(_Wire):
    """A stage's worker → orchestrator. `error` set: the stage failed this request."""

    type: Literal["stage_output"] = "stage_output"
    request_id: RequestId
    data: Any
    finished: bool
    error: str | None = None
    seq: Annotated[int, Field(ge=0)] = 0
    """Index of this output within the request at this stage: a replica that re-runs a
    request taken over from a dead one repeats seqs the orchestrator already has."""


class OrchOutputMsg(_Wire):
    """Orchestrator → the client that submitted the request."""

    type: Literal["orch_output"] = "orch_output"
    request_id: RequestId
    stage_id: int
    data: Any
    finished: bool
    error: str | None = None
    seq: Annotated[int, Field(ge=0)]
    """0, 1, 2, ... per request, assigned by the orchestrator as it emits: the client drops
    repeats and turns a gap into an error instead of a success that misses data."""


class DurableRequest(_Wire):
    """A request's routing state as its owner keeps it in Redis, so another can finish it.

    The stage data `forward_fn` will still need (sequential mode, stages not yet
    finished) is kept beside it, one hash field per chunk, written once each:
    `stage_chunks` says how many there are per stage (`redis_io/request_store.py`).
    `stage_data` holds it inline, as states were written before. `stage_seq` is, per
    stage, the next output seq not yet handled; `out_seq` the seq of the client's next
    output; `deadline_at` a wall-clock time.
    """

    type: Literal["request_state"] = "request_state"
    request_id: RequestId
    client_id: ClientId
    prompt: Any
    deadline_at: float | None
    submitted: list[int]
    finished: list[int]
    stage_data: dict[int, list[Any]] = Field(default_factory=dict)
    stage_chunks: dict[int, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    stage_seq: dict[int, int] = Field(default_factory=dict)
    out_seq: Annotated[int, Field(ge=0)] = 0
    params: dict[str, Any] | None = None


ClientCommand = Annotated[RequestMsg | AbortMsg, Field(discriminator="type")]
"""What may appear on the requests stream."""
