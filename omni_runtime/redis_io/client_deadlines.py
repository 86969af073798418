"""The client's own deadline for every request, and what it knows when one passes.

The orchestrator ends a request that outlives its deadline, but its error final is
a write like any other: with Redis unreachable, out of memory, or no orchestrator
alive, it never arrives. So the client keeps every request's deadline too, plus a
grace (`OMNI_DEADLINE_GRACE_S`) for the orchestrator's own final to come first, and
ends a request still waiting then with one error final of its own, saying what it
knows: Redis unreachable, Redis out of memory, or no answer at all. No request waits
past its deadline and grace, whatever Redis and the orchestrators do.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from omni_runtime.core.deadlines import Deadlines
from omni_runtime.errors import OOM_MESSAGE
from omni_runtime.redis_io.refusals import is_oom, oom_message

DEADLINE_EXCEEDED = "deadline exceeded"
"""How the orchestrator's error final for a late request begins, and the client's too."""


@dataclass
class RedisCondition:
    """What this client last learned of Redis: since when it is unreachable (its reads
    fail), and when it last refused a write for memory, with what it said."""

    unreachable_since: float | None = None
    unreachable_error: str = ""
    oom_at: float | None = None
    """When a write was last refused for memory (kept once memory is back: a request
    submitted before then may have lost a write to it)."""
    oom_message: str = ""
    oom_now: bool = False
    oom_total: int | None = None
    """Redis's own count of writes it refused for memory, as last read."""
    restarted_at: float | None = None
    """When Redis was last seen back empty (its epoch token gone)."""

    def unreachable(self, error: BaseException, now: float) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = now
        self.unreachable_error = f"{type(error).__name__}: {error}"

    def reachable(self) -> None:
        self.unreachable_since = None

    def refused_for_memory(self, message: str, now: float) -> None:
        self.oom_at, self.oom_message, self.oom_now = now, message, True

    def refusals_counted(self, total: int, now: float) -> None:
        """Redis's count of the writes it refused for memory, anyone's (`INFO errorstats`):
        one that grew since the last look means Redis is full, whoever was refused (what
        Redis said to this client itself, just now, says it better)."""
        before, self.oom_total = self.oom_total, total
        if before is not None and total > before and not (self.oom_now and self.oom_at == now):
            said = f"it refused {total - before} writes since the last look (maxmemory reached)"
            self.refused_for_memory(
                f"{OOM_MESSAGE}: {said}; raise its maxmemory, or retry later", now
            )

    def beat(self, reply: object, stats: list[object], now: float) -> bool:
        """A heartbeat's replies: its SET's (refused for memory, or taken), and Redis's
        count of refusals if it was asked (`INFO errorstats`). False if that count could
        not be read (an ACL without INFO, a server without errorstats): ask no more.
        Raises any other error."""
        if isinstance(reply, RedisError):
            if not is_oom(reply):
                raise reply
            self.refused_for_memory(oom_message(reply), now)
        else:
            self.room()
        if stats and isinstance(stats[0], dict):  # others' writes refused count too
            oom = stats[0].get("errorstat_OOM")
            self.refusals_counted(int(oom["count"]) if oom else 0, now)
            return True
        return not stats

    def room(self) -> None:
        """A write that needs memory went through."""
        self.oom_now = False

    @property
    def out_of_memory(self) -> str | None:
        """What Redis said, while it refuses writes for memory."""
        return self.oom_message if self.oom_now else None

    def why(self, submitted_at: float, now: float) -> str:
        """Why a request submitted at `submitted_at` may have had no answer."""
        if self.unreachable_since is not None:
            down_s = now - self.unreachable_since
            return f"Redis unreachable for {down_s:.1f} s ({self.unreachable_error})"
        if self.oom_now:
            return self.oom_message
        if self.oom_at is not None and self.oom_at >= submitted_at:
            return f"{self.oom_message}, {now - self.oom_at:.1f} s ago"
        if self.restarted_at is not None and self.restarted_at >= submitted_at:
            return (
                "Redis restarted empty since, and no orchestrator answered for the request: "
                "it was lost with Redis's data"
            )
        return "no answer from the orchestrator"


class ClientDeadlines:
    """Every request's deadline plus the grace, on one heap; `run` ends each one that
    passes by calling `end(request id, error)` (the client ignores one already ended)."""

    def __init__(self, grace_s: float, condition: RedisCondition) -> None:
        self.grace_s = grace_s
        self.condition = condition
        self._heap = Deadlines()
        self._of: dict[str, tuple[float, float]] = {}
        """request id → (submitted at, deadline in seconds)."""
        self._sooner = asyncio.Event()
        self._waiting_until: float | None = None

    def __len__(self) -> int:
        return len(self._of)

    def add(self, request_id: str, deadline_s: float, now: float) -> None:
        at = now + deadline_s + self.grace_s
        self._heap.add(request_id, at)
        self._of[request_id] = (now, deadline_s)
        if self._waiting_until is None or at < self._waiting_until:
            self._sooner.set()  # (requests share one deadline as a rule: it seldom wakes)

    def cancel(self, request_id: str) -> None:
        """The request ended (or its consumer let it go): no deadline of the client's."""
        if self._of.pop(request_id, None) is not None:
            self._heap.cancel(request_id)

    async def run(self, end: Callable[[str, str], None]) -> None:
        """Until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            self._sooner.clear()
            now = loop.time()
            request_id = self._heap.pop_due(now)
            if request_id is not None:
                submitted_at, deadline_s = self._of.pop(request_id)
                why = self.condition.why(submitted_at, now)
                end(
                    request_id,
                    f"{DEADLINE_EXCEEDED}: no final within {deadline_s:g} s "
                    f"(+{self.grace_s:g} s grace) of submission; {why}",
                )
                continue
            self._waiting_until = self._heap.next_at()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(self._waiting_until):
                    await self._sooner.wait()
