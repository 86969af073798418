"""Every Redis name and default TTL the runtime uses, in one place.

No other module builds a key string or hard-codes a TTL: a reader of this file
knows everything the runtime can leave behind in Redis and for how long.
"""

from __future__ import annotations

# --- data plane (ChunkAdapter) -------------------------------------------------

CHUNK_TTL_S = 300
"""A chunk nobody consumes (receiver died, request aborted) expires after this."""


def chunk_key(request_id: str, stage_id: int, chunk_id: int, prefix: str = "") -> str:
    """`<req>_<stage>_<id>` (SPEC §4), optionally behind a namespace prefix."""
    return f"{prefix}{request_id}_{stage_id}_{chunk_id}"
