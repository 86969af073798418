"""In-process value types shared by the orchestrator, stages and clients (SPEC §2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(slots=True)
class StageOutput:
    """Stage → orchestrator. Carries no stage id: only its reader knows the stage."""

    request_id: str
    data: Any
    finished: bool


@dataclass(slots=True)
class OrchOutput:
    """Orchestrator → user; produced only for final stages and for errors."""

    request_id: str
    stage_id: int
    data: Any
    finished: bool
    error: str | None = None


@dataclass(slots=True)
class ReqState:
    """Everything the orchestrator knows about one live request."""

    prompt: Any
    submitted: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    stage_data: dict[int, list[Any]] = field(default_factory=dict)
    pending_final: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StageFailure:
    """The `data` of a StageOutput whose stage failed the request; ends it with an error."""

    error: str


@runtime_checkable
class Stage(Protocol):
    """A stage as the orchestrator sees it: in-process fake or Redis client alike."""

    async def submit(self, request_id: str, data: Any) -> None: ...

    async def get_output(self) -> list[StageOutput]:
        """Wait until at least one output exists; the list may mix requests."""
        ...


@runtime_checkable
class Connector(Protocol):
    """The ChunkAdapter's data plane: `get` consumes, `None` means not there yet."""

    def put(self, key: str, obj: Any) -> None: ...

    def get(self, key: str) -> Any | None: ...


@dataclass(frozen=True, slots=True)
class MalformedChunk:
    """Stands in, in a connector's `get_many` result, for a value that failed to decode.

    The value was already consumed, so the receiver skips its id instead of
    waiting for it forever; it counts and logs the loss.
    """

    key: str
    error: str
