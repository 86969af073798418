"""The SPEC §3 seed pipeline: split words → uppercase them all → "wav:" each.

Small enough to check by eye, so the end-to-end tests can assert exact outputs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from omni_runtime.stage_api import Final, marks_final, with_last


@marks_final
def split_words(data: Any) -> Iterator[Any]:
    """Stage 0: each whitespace-separated word of the prompt, the last one sent at once.

    An empty prompt yields nothing, so the stage emits one `None`, finished.
    """
    words = str(data).split() if data is not None else []
    for word, last in with_last(words):
        yield Final(word) if last else word


def upper_all(
    data: Iterable[Any], fail_word: str | None = None, delay_ms: float = 0.0
) -> list[str]:
    """Stage 1: one chunk, the list of all stage-0 words uppercased.

    `None` items (stage 0's "no words" marker) are skipped. `fail_word` provokes a stage
    error on purpose, so tests can exercise error routing; `delay_ms` stands in for compute.
    """
    if delay_ms > 0:
        time.sleep(delay_ms / 1000)
    words = [str(w) for w in data if w is not None]
    if fail_word is not None and fail_word in words:
        raise ValueError(f"refusing {fail_word!r}")
    return [w.upper() for w in words]


@marks_final
def prefix_wav(data: Iterable[Any]) -> Iterator[Any]:
    """Stage 2: "wav:" + each word of every stage-1 chunk (a list of words), last one final.

    Nested `with_last` marks the last word as soon as it is known, also when `data` is a
    streaming `ChunkStream`. No words → nothing yielded → one `None`, finished.
    """
    for chunk, last_chunk in with_last(data):
        for word, last_word in with_last(chunk or []):
            out = f"wav:{word}"
            yield Final(out) if last_chunk and last_word else out
