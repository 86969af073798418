"""Stages of `long_outputs.yaml`: a stage 0 that streams many fixed-size chunks, a stage 1
that reads them all and answers with one summary, so the client can check every chunk
arrived, in order, and is told nothing else.

The prompt says how much: `{"chunks": N, "bytes": S, "gap_ms": G}`, so one deployment
serves every size of the scenario.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from omni_runtime.stage_api import Final, marks_final

_BLOCK = os.urandom(1 << 20)
"""Chunk bodies are cut from it: incompressible, and nothing to compute per chunk."""


@marks_final
def stream_chunks(data: dict[str, Any]) -> Iterator[Any]:
    """Stage 0: `chunks` byte strings of `bytes` bytes, `gap_ms` apart (a decode step's
    pace); each starts with its index (4 bytes, big-endian), so stage 1 can check the order."""
    n, size, gap_s = int(data["chunks"]), int(data["bytes"]), float(data["gap_ms"]) / 1000
    body = _BLOCK[: max(0, size - 4)]
    for i in range(n):
        if gap_s > 0:
            time.sleep(gap_s)
        chunk = i.to_bytes(4, "big") + body
        yield Final(chunk) if i == n - 1 else chunk


def summarize(data: Iterable[Any]) -> dict[str, Any]:
    """Stage 1: how many chunks and bytes arrived, and whether they came in order."""
    count = size = 0
    in_order = True
    for chunk in data:
        in_order &= int.from_bytes(chunk[:4], "big") == count
        count += 1
        size += len(chunk)
    return {"chunks": count, "bytes": size, "in_order": in_order}
