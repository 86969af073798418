"""The per-request voice parameters every TTS stage honours: `voice` and `speed` (and
`modalities`, `core.types.wants_audio`: no speech when they leave audio out).

A request's `params` win over the stage's options; keys meant for other stages
(`max_tokens`, `temperature`, ...) pass by. Bad values fail the request with a clear
error instead of being clamped or ignored. One exception: OpenAI's built-in voice names
(`alloy`, ...), which OpenAI clients send by default, speak in the stage's own voice
unless the stage maps them (its `voices` option), so those clients work on any pipeline.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_runtime.errors import in_words
from omni_runtime.stage_api import RequestRefused

MIN_SPEED = 0.25
MAX_SPEED = 4.0
OPENAI_VOICES = frozenset({
    "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx",
    "sage", "shimmer", "verse",
})  # fmt: skip
"""The voices OpenAI's speech, chat audio and Realtime APIs offer."""


class VoiceParams(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    voice: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    speed: Annotated[float, Field(ge=MIN_SPEED, le=MAX_SPEED, allow_inf_nan=False, strict=True)] = (
        1.0
    )


def voice_params(
    params: dict[str, Any] | None, voice: str | None, speed: float, known: Collection[str] = ()
) -> VoiceParams:
    """The voice and speed for one request: its `params`, else the stage's options (`voice`,
    `speed`; `known`: the names its `voices` option maps). An OpenAI voice name the stage
    does not know keeps the stage's voice."""
    merged: dict[str, Any] = {"voice": voice, "speed": speed}
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"request params must be a dict, got {type(params).__name__}")
        merged.update({k: params[k] for k in ("voice", "speed") if params.get(k) is not None})
        if merged["voice"] in OPENAI_VOICES and merged["voice"] not in known:
            merged["voice"] = voice
    try:
        return VoiceParams.model_validate(merged)
    except ValidationError as e:
        raise RequestRefused(f"bad voice parameters: {in_words(e)}", "invalid_value") from None
