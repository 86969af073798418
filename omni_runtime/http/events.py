"""What a run yields to the endpoints: its text and calls from the text stage, its audio
from the audio stage, or the failure that ended it (with the HTTP error it becomes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from omni_runtime.core.tool_calls import ToolCall
from omni_runtime.http.errors import ApiError
from omni_runtime.http.transcripts import TimedText


@dataclass(frozen=True, slots=True)
class TextEvent:
    text: str
    timing: TimedText | None = None
    """When the piece was said, if its stage gave it (`transcripts`)."""


@dataclass(frozen=True, slots=True)
class ToolCallEvent:
    """Calls of the request's tools the answer made (each whole), `first` the index of the
    first of them among all its calls."""

    calls: list[ToolCall]
    first: int = 0


@dataclass(frozen=True, slots=True)
class AudioEvent:
    pcm: npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class FailureEvent:
    message: str
    status: int = 502
    code: str = "pipeline_error"

    @classmethod
    def of(cls, stage_id: int, error: str, error_code: str | None) -> FailureEvent:
        """A request's error final: a 400 with the stage's code when the stage refused the
        request for what it asked (`stage_api.RequestRefused`), a 503 for one the drain
        cut, else a 502."""
        if error == SHUTTING_DOWN:
            return cls(error, 503, "shutting_down")
        message = failure_message(stage_id, error)
        return cls(message, 400, error_code) if error_code else cls(message)

    def api_error(self) -> ApiError:
        return ApiError(self.status, self.message, code=self.code)


Event = TextEvent | ToolCallEvent | AudioEvent | FailureEvent

SHUTTING_DOWN = "the server shut down before the answer was done"
"""The error of every request still in flight once `serve`'s drain (`OMNI_DRAIN_S`) ran out."""


def failure_message(stage_id: int, error: str) -> str:
    """A failed request's error, its stage named once (a stage's own failure says
    "stage 1 failed: …"; a deadline or an abort does not name one)."""
    return error if error.startswith(f"stage {stage_id} ") else f"stage {stage_id}: {error}"
