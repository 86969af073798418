"""Stage code that shows what per-request parameters reach it, for the tests of their path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omni_runtime.stage_api import ChunkStream, EngineOutput


def tag_words(data: Any, params: dict[str, Any] | None = None) -> Iterator[str]:
    """Stage 0 (a generator): each word of the prompt, tagged with `params["tag"]`."""
    tag = (params or {}).get("tag", "-")
    for word in str(data).split():
        yield f"{word}/{tag}"


class SuffixEngine:
    """A later stage (a step engine declaring `params`): all upstream chunks, each with
    `params["suffix"]` appended, as one list once the upstream ended (either mode)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[ChunkStream, list[str], str]] = {}

    def add_request(self, request_id: str, data: Any, params: dict[str, Any] | None) -> None:
        stream = data if isinstance(data, ChunkStream) else ChunkStream(data, closed=True)
        self._held[request_id] = (stream, [], str((params or {}).get("suffix", "")))

    def has_work(self) -> bool:
        return any(stream.closed for stream, _seen, _suffix in self._held.values())

    def abort(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def step(self) -> list[EngineOutput]:
        outputs = []
        for rid, (stream, seen, suffix) in list(self._held.items()):
            closed = stream.closed  # before take: then nothing more comes after it
            seen.extend(f"{c}{suffix}" for c in stream.take() if c is not None)
            if closed:
                del self._held[rid]
                outputs.append(EngineOutput(rid, seen, True))
        return outputs
