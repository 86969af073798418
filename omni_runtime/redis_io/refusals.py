"""What an error reply to one command means for the writer: out of memory, try again, never;
and what becomes of the writes a refused command carried.

Redis answers each command of a pipeline on its own, so one refused command says
nothing of the others. Out of memory (`OOM command not allowed when used memory >
'maxmemory'`, under `noeviction`) refuses only commands that may grow memory (XADD,
HSET, SET); acknowledgements and deletions still pass, and what needs memory may pass
again once some was freed. A few replies say "not now" (a replica just promoted, a
server still loading), and so does a command a Redis Cluster pipeline could not deliver
(its node died: redis-py puts the connection error in that command's place while the
replica takes over); any other error will come again however often the command is
sent (an expiry out of range, a key of the wrong type, a command the ACL forbids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from omni_runtime.errors import OOM_MESSAGE
from omni_runtime.redis_io.write_ops import HashPut, Op, XAdd

TRANSIENT_PREFIXES = ("BUSY", "LOADING", "MASTERDOWN", "MISCONF", "NOREPLICAS", "TRYAGAIN")
"""Error replies redis-py leaves unclassified that mean "not now" (the first word)."""


class Refusal(Enum):
    OUT_OF_MEMORY = "out of memory"
    TRANSIENT = "transient"
    PERMANENT = "permanent"


def refusal(e: RedisError) -> Refusal:
    """The kind of one command's error reply."""
    if isinstance(e, OutOfMemoryError) or str(e).startswith("OOM "):
        return Refusal.OUT_OF_MEMORY
    if isinstance(e, ReadOnlyError | TryAgainError | ClusterDownError | MovedError | AskError):
        return Refusal.TRANSIENT
    if isinstance(e, RedisConnectionError | RedisTimeoutError):  # not delivered, or unanswered
        return Refusal.TRANSIENT
    if str(e).split(" ", 1)[0] in TRANSIENT_PREFIXES:
        return Refusal.TRANSIENT
    return Refusal.PERMANENT


def is_oom(e: BaseException) -> bool:
    return isinstance(e, RedisError) and refusal(e) is Refusal.OUT_OF_MEMORY


def oom_message(e: BaseException) -> str:
    """`OOM_MESSAGE` and what Redis said (redis-py strips the `OOM` prefix)."""
    said = str(e).removeprefix("OOM ").strip().rstrip(".") or "maxmemory reached"
    return f"{OOM_MESSAGE}: it refuses writes ({said}); raise its maxmemory, or retry later"


@dataclass
class MemorySeen:
    """What one writer saw of Redis refusing writes for memory (loop times)."""

    now: str | None = None
    """What Redis said, while it refuses (None once a write that needs memory went in)."""
    last_at: float | None = None
    last: str = ""

    def refused(self, error: RedisError, at: float) -> str:
        """One refusal; the message to give (`oom_message`)."""
        self.now = self.last = oom_message(error)
        self.last_at = at
        return self.now

    def since(self, at: float) -> str | None:
        """What Redis said, if it refused a write for memory at `at` or later: why a
        request alive since then may have made no progress."""
        return self.last if self.last_at is not None and self.last_at >= at else None


@dataclass
class Replies:
    """A round trip's replies sorted by what becomes of the ops each command carried."""

    written: list[Op] = field(default_factory=list)
    again: list[Op] = field(default_factory=list)
    """Refused for now (transient): written again at once, within the retry bound."""
    out_of_memory: list[tuple[list[Op], RedisError]] = field(default_factory=list)
    failed: list[tuple[list[Op], RedisError]] = field(default_factory=list)
    """Refused for good: never written again."""
    needed_memory: bool = False
    """A command that may grow memory (XADD, HSET) went through: Redis has room again."""


def sort_replies(replies: list[Any], carried: list[list[Op]]) -> Replies:
    """Each command's reply against the ops it carried (`fill_pipeline`). An op two commands
    carry (an acknowledgement and its deletion) takes the worse of their outcomes."""
    worst: dict[int, tuple[int, Op, RedisError | None]] = {}
    for reply, ops in zip(replies, carried, strict=True):
        if isinstance(reply, RedisError):
            rank = {Refusal.TRANSIENT: 1, Refusal.OUT_OF_MEMORY: 2, Refusal.PERMANENT: 3}
            level: int = rank[refusal(reply)]
        else:
            level = 0
        for op in ops:
            seen = worst.get(id(op))
            if seen is None or seen[0] < level:
                worst[id(op)] = (level, op, reply if level else None)
    out = Replies()
    grouped: dict[int, tuple[list[Op], RedisError]] = {}
    for level, op, error in worst.values():
        if level == 0:
            out.written.append(op)
            out.needed_memory |= isinstance(op, XAdd | HashPut)
        elif level == 1:
            out.again.append(op)
        else:
            assert error is not None
            ops, _e = grouped.setdefault(id(error), ([], error))
            ops.append(op)
    for ops, error in grouped.values():
        kind = refusal(error)
        (out.out_of_memory if kind is Refusal.OUT_OF_MEMORY else out.failed).append((ops, error))
    return out
