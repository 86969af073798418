"""The one chunk of look-ahead every generator-like stage runs through (functions,
generators and async engines alike), so a request's last chunk leaves marked finished."""

from __future__ import annotations

from typing import Any, Protocol

from omni_runtime.core.types import FinishReason, TokenUsage
from omni_runtime.stage_api import Final


class Emit(Protocol):
    """(request id, data, finished) -> False once the request is aborted."""

    def __call__(
        self,
        request_id: str,
        data: Any,
        finished: bool,
        *,
        finish_reason: FinishReason | None,
        usage: TokenUsage | None,
    ) -> bool: ...


class LastChunkSink:
    """One chunk of look-ahead, so the last chunk can be marked finished — unless the
    stage is `marks_final`, whose chunks go out the moment they are yielded."""

    _EMPTY = object()

    def __init__(self, request_id: str, emit: Emit, hold: bool = True) -> None:
        self.request_id = request_id
        self.emit = emit
        self.hold = hold
        self.held: Any = self._EMPTY
        self.done = False

    def push(self, item: Any) -> bool:
        """False: stop producing (aborted, or `Final` already sent)."""
        if self.held is not self._EMPTY and not self._emit(self.held, False):
            return False
        self.held = self._EMPTY
        if isinstance(item, Final):
            self.done = True
            self.emit(
                self.request_id, item.data, True, finish_reason=item.finish_reason, usage=item.usage
            )
            return False
        if not self.hold:
            return self._emit(item, False)
        self.held = item
        return True

    def end(self) -> None:
        """The generator is exhausted: its last chunk (or a `None`) closes the request."""
        if self.done:
            return
        last = None if self.held is self._EMPTY else self.held
        self._emit(last, True)

    def _emit(self, data: Any, finished: bool) -> bool:
        return self.emit(self.request_id, data, finished, finish_reason=None, usage=None)
