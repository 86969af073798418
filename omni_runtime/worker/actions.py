"""What crosses between the worker core and its shell: inputs in, actions out.

Plain data, so the core stays free of I/O and the shell's threads can build inputs
and ownership snapshots without importing the core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from omni_runtime.stage_api import ChunkStream
from omni_runtime.wire.messages import StageInputMsg
from omni_runtime.wire.views import StageInputView


@dataclass(slots=True)  # not frozen: a frozen __init__ costs ~4x, and one is made per input
class Input:
    """A validated input and its stream entry; `refused`: why its request fails unrun."""

    entry_id: bytes
    msg: StageInputView | StageInputMsg
    """As read (a view) or as built in-process (the model): the same fields."""
    refused: str | None = None
    taken_over: bool = False
    """Claimed from a dead replica (after any ownership snapshot that listed it as theirs)."""
    solo: bool = False
    """Delivered again often enough to be a suspect: it runs alone (`isolation.py`)."""


@dataclass(slots=True)  # not frozen, like Input: one per output
class Outgoing:
    """One encoded `StageOutputMsg`; `ack`: the input entry it ends, acknowledged with it."""

    request_id: str
    seq: int
    payload: bytes
    ends: bool
    is_error: bool
    ack: bytes | None = None


@dataclass(slots=True)
class Actions:
    """What the shell must do, in this order: publish `outputs` and `acks` (one batch), then
    load receivers, save chunks, discard, clean up receivers; give back `freed_slots`."""

    outputs: list[Outgoing] = field(default_factory=list)
    acks: list[bytes] = field(default_factory=list)
    chunk_saves: list[tuple[str, msgspec.Raw, bool]] = field(default_factory=list)
    """(request, its output's data as encoded for its output message, final): the chunk
    carries the same bytes (`chunks.redis.RedisConnector` writes them as they are)."""
    discards: list[str] = field(default_factory=list)
    receiver_loads: list[str] = field(default_factory=list)
    receiver_cleanups: list[str] = field(default_factory=list)
    freed_slots: int = 0


@dataclass(slots=True)
class ActiveRequest:
    """The core's record of a request running here."""

    entry_id: bytes
    last_input_at: float
    stream: ChunkStream | None = None
    seq: int = 0
    sends_chunks: bool = False
    """Its outputs go to the next stage as chunks (streaming, and it goes on past here)."""


def stream_id(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class Ownership:
    """The input stream's pending list, read after this replica may have stalled past its
    heartbeat TTL (see `fence.py`): which inputs another replica claimed meanwhile."""

    mine: frozenset[bytes]
    others: frozenset[bytes]
    last_delivered: tuple[int, int]
    """The group's last delivered id: what is delivered after the snapshot is newer."""

    def lost(self, entry_id: bytes) -> bool:
        """Pending under another consumer, or delivered before the snapshot and no longer
        pending at all (another replica claimed and finished it)."""
        if entry_id in self.mine:
            return False
        return entry_id in self.others or stream_id(entry_id) <= self.last_delivered
