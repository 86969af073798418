"""A TTS stage's text input as clauses, each as soon as it is complete (the cutter:
`core/clauses.py`), with whether it is the last.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from omni_runtime.core.clauses import (
    DEFAULT_FIRST_CLAUSE_CHARS as DEFAULT_FIRST_CLAUSE_CHARS,
)
from omni_runtime.core.clauses import (
    DEFAULT_MAX_CLAUSE_CHARS as DEFAULT_MAX_CLAUSE_CHARS,
)
from omni_runtime.core.clauses import (
    DEFAULT_MIN_CLAUSE_CHARS as DEFAULT_MIN_CLAUSE_CHARS,
)
from omni_runtime.core.clauses import ClauseCutter
from omni_runtime.core.tool_calls import calls_in
from omni_runtime.core.types import wants_audio
from omni_runtime.stage_api import ChunkStream, RequestRefused, with_last


def clauses_with_last(
    data: Any,
    min_clause_chars: int = DEFAULT_MIN_CLAUSE_CHARS,
    max_clause_chars: int = DEFAULT_MAX_CLAUSE_CHARS,
    first_clause_chars: int | None = None,
) -> Iterator[tuple[str, bool]]:
    """Each clause of a stage's text input (stripped, never blank), with whether it is the last.

    `data` is a string (a prompt) or text deltas (a list, or a `ChunkStream` read as the
    chunks arrive); `None` deltas (an upstream's closing chunk) and calls of tools (a
    thinker's answer that is calls: `core/tool_calls.py`) are skipped. A clause goes
    out as soon as it is complete. When the input ends after the last clause was already
    given, a closing `("", True)` says so.
    """
    cutter = ClauseCutter(min_clause_chars, max_clause_chars, first_clause_chars)
    if isinstance(data, str):
        deltas: Iterable[Any] = [data]
    elif isinstance(data, ChunkStream | list | tuple):
        deltas = data
    else:
        raise TypeError(
            f"expected text (a str, or a list of str deltas), got {type(data).__name__}"
        )
    ended = False
    for delta, is_last in with_last(deltas):
        if calls_in(delta) is not None:
            delta = None  # a thinker's calls of tools: nothing to say
        elif delta is not None and not isinstance(delta, str):
            raise TypeError(f"expected text deltas (str), got {type(delta).__name__}")
        pieces = cutter.feed(delta or "")
        if is_last:
            pieces += cutter.flush()
        spoken = [p.strip() for p in pieces if p.strip()]
        for k, clause in enumerate(spoken):
            last = is_last and k == len(spoken) - 1
            ended = ended or last
            yield clause, last
    if not ended:
        yield "", True


def first_clause_chars_of(params: dict[str, Any] | None, option: int | None) -> int | None:
    """The first piece's limit for one request: its `first_clause_chars` param if it has one
    (0: none, the text comes cut already: a speech stream's pieces), else the stage's."""
    given = (params or {}).get("first_clause_chars")
    if given is None:
        return option
    if type(given) is not int or not 0 <= given <= DEFAULT_MAX_CLAUSE_CHARS:
        raise RequestRefused(
            f"first_clause_chars must be an int in 0..{DEFAULT_MAX_CLAUSE_CHARS}, not {given!r}",
            "invalid_value",
        )
    return given or None


def request_clauses(
    data: Any,
    params: dict[str, Any] | None,
    min_clause_chars: int,
    max_clause_chars: int,
    first_clause_chars: int | None,
) -> Iterator[tuple[str, bool]]:
    """`clauses_with_last` for one request of a TTS stage: its `first_clause_chars` param
    wins over the stage's; one that wants no audio (`core.types.wants_audio`) has its
    input read to the end (the upstream's chunks taken) and gets only `("", True)`."""
    first = first_clause_chars_of(params, first_clause_chars)
    clauses = clauses_with_last(data, min_clause_chars, max_clause_chars, first)
    if wants_audio(params):
        yield from clauses
        return
    for _clause, is_last in clauses:
        if is_last:
            yield "", True
