"""In-process value types shared by the orchestrator, stages and clients (SPEC §2)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "tool_calls"]
"""Why a stage's output ended, when its code says (`stage_api.Final`): "length" is a limit
reached (`max_tokens`), which OpenAI's API reports as `finish_reason: "length"`;
"tool_calls", an answer that is calls of the request's tools (`core/tool_calls.py`)."""


MAX_TOKEN_COUNT = 2**32 - 1
"""The largest token count a `TokenUsage` (and the wire) carries."""
MAX_PARAM_STR_CHARS = 4096
"""The longest string a request parameter (the wire's `params`) carries."""


def param_json(value: Any) -> str:
    """A JSON value as a request parameter carries it (a parameter is flat): compact text."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """The model's own token counts for one request, when its engine reports them: what
    OpenAI's `usage` says (else the front door estimates them)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Of the prompt's tokens, those the engine did not read again: it had their state from
    an earlier prompt that began with them (its prompt cache)."""

    def __post_init__(self) -> None:
        """Checked where an engine makes it: a count the wire refuses would lose the
        request's last output, and the request would wait out its deadline."""
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            n = getattr(self, name)
            if type(n) is not int or not 0 <= n <= MAX_TOKEN_COUNT:
                raise ValueError(f"{name} must be an int in 0..{MAX_TOKEN_COUNT}, not {n!r}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens {self.cached_tokens} > prompt_tokens")

    @classmethod
    def read(
        cls,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        cached_tokens: int | None = None,
    ) -> TokenUsage | None:
        """The counts as a message carries them (both, or none; the cached ones may be left
        out, as 0). A message is checked when read, so no count here is out of range; one
        cached count above the prompt's is taken as all of them."""
        if prompt_tokens is None or completion_tokens is None:
            return None
        return cls(prompt_tokens, completion_tokens, min(cached_tokens or 0, prompt_tokens))


def wants_audio(params: Mapping[str, Any] | None) -> bool:
    """Whether a request wants speech: not when its `modalities` leave audio out (what the
    front door adds for a client that wants only text from a pipeline that speaks)."""
    modalities = (params or {}).get("modalities")
    return not isinstance(modalities, list) or "audio" in modalities


FINAL_STAGES_PARAM = "final_stages"
"""The `params` key of a request that wants fewer final stages than its pipeline has: a
list of some of them (the transcript alone of a pipeline that hears and answers)."""


def asked_finals(final_stage_ids: frozenset[int], params: Mapping[str, Any] | None) -> str | None:
    """Why a request's `final_stages` cannot be served, or None (not given, or sound)."""
    asked = (params or {}).get(FINAL_STAGES_PARAM)
    sound = isinstance(asked, list) and all(type(s) is int and s in final_stage_ids for s in asked)
    if asked is None or (sound and asked):
        return None
    finals = sorted(final_stage_ids)
    return f"{FINAL_STAGES_PARAM} must list some of the final stages {finals}, not {asked!r}"


def request_finals(
    final_stage_ids: frozenset[int], audio_stage: int | None, params: Mapping[str, Any] | None
) -> frozenset[int]:
    """The final stages one request needs: those it asks for (`FINAL_STAGES_PARAM`, checked
    at intake: `asked_finals`), else all of the pipeline's; but the audio stage for a
    request that wants no audio, so the stages that would speak for nobody are not run."""
    finals = final_stage_ids
    asked = (params or {}).get(FINAL_STAGES_PARAM)
    if isinstance(asked, list):
        finals = final_stage_ids & {s for s in asked if type(s) is int} or final_stage_ids
    if audio_stage is None or wants_audio(params):
        return finals
    return finals - {audio_stage} or finals


ForwardFn = Callable[[int, Any, list[Any]], Any]
"""`forward_fn(next_stage_id, prompt, all data of the previous stage) -> next input`."""


def forward_previous_data(next_stage_id: int, prompt: Any, previous: list[Any]) -> Any:
    """The default forward function: the next stage gets all of the previous stage's data."""
    return previous


@dataclass(slots=True)
class StageOutput:
    """Stage → orchestrator. Carries no stage id: only its reader knows the stage."""

    request_id: str
    data: Any
    finished: bool
    finish_reason: FinishReason | None = None
    """Set on a finished output whose stage said why it ended."""
    usage: TokenUsage | None = None
    """Set on a finished output whose stage counted its tokens."""


@dataclass(slots=True)
class OrchOutput:
    """Orchestrator → user; produced only for final stages and for errors."""

    request_id: str
    stage_id: int
    data: Any
    finished: bool
    error: str | None = None
    error_code: str | None = None
    """Set when a stage refused the request for what it asked (`stage_api.RequestRefused`)."""
    finish_reason: FinishReason | None = None
    """The stage's `StageOutput.finish_reason`, on its finished output."""
    usage: TokenUsage | None = None
    """The stage's `StageOutput.usage`, on its finished output."""


@dataclass(slots=True)
class ReqState:
    """Everything the orchestrator knows about one live request."""

    prompt: Any
    params: dict[str, Any] | None = None
    """Per-request parameters, sent with the request's input to every stage."""
    finals: frozenset[int] = frozenset()
    """The final stages this request needs (`request_finals`), set when it is registered."""
    last_stage: int = 0
    """The last of them: the stages after it are not run for this request."""
    submitted: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    stage_data: dict[int, list[Any]] = field(default_factory=dict)
    pending_final: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StageFailure:
    """The `data` of a StageOutput whose stage failed the request; ends it with an error."""

    error: str
    code: str | None = None
    """The stage refused the request for what it asked (`OrchOutput.error_code`)."""


@runtime_checkable
class Stage(Protocol):
    """A stage as the orchestrator sees it (SPEC §2): in-process or over Redis alike."""

    async def submit(
        self, request_id: str, data: Any, params: dict[str, Any] | None = None
    ) -> None: ...

    async def get_output(self) -> list[StageOutput]:
        """Wait until at least one output exists; the list may mix requests."""
        ...


@runtime_checkable
class ManagedStage(Stage, Protocol):
    """A stage that also takes the orchestrator's lifecycle calls (the Redis one does).

    The orchestrator checks for it once, at construction; a plain `Stage` gets none.
    """

    def output_handled(self, out: StageOutput) -> None:
        """`out` was routed: a durable stage may acknowledge it now, never before."""

    async def abort(self, request_id: str) -> None:
        """Drop the request wherever the stage holds it."""

    async def quiesce(self) -> None:
        """Stop reading between two reads (shutdown), so no read is cut in half."""

    def request_ended(self, request_id: str) -> None:
        """The orchestrator forgot the request: per-request memory may go too."""


class CounterSink(Protocol):
    """Where core components count (`omni_runtime.observe.metrics.Metrics` is one)."""

    def inc(self, name: str, amount: float = 1, **labels: object) -> None: ...


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
