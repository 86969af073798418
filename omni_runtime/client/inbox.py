"""The client's side of SPEC §6: per-request buffers that check every output's `seq`.

A repeat is dropped and counted; a gap ends the request with one error final
(never a success that misses data); a buffer its consumer lets grow past the
bound ends the request too, freeing what it held. A request the client ended
itself is remembered for a while, so the outputs still on their way drop quietly;
every map here follows the live requests plus that age-limited memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from omni_runtime import keys
from omni_runtime.core.types import OrchOutput, TokenUsage
from omni_runtime.observe.metrics import Metrics
from omni_runtime.wire.views import OrchOutputView

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """One request the client waits on: its outputs in order, and the next seq expected."""

    queue: asyncio.Queue[OrchOutput] = field(default_factory=asyncio.Queue)
    next_seq: int = 0
    ended: bool = False
    """Its final (or the error the client ended it with) is queued: nothing more goes in."""
    error: str | None = None
    """The error it ended with (its final's, or the client's own)."""


_IDLE = OrchOutput("", -1, None, False)
"""What `IdleWait`'s timer queues when nothing came in time (compared by identity)."""


class IdleWait:
    """The consumer's side of one request's queue: `next` returns None once it has waited
    `timeout_s` for an output that did not come.

    One timer per `timeout_s` of waiting, re-armed lazily, not one per wait: a request
    streaming a chunk every few ms would arm and cancel a timer per chunk
    (`asyncio.timeout`), ~13 % of a streaming client's CPU. Time the consumer spends
    between outputs does not count: only waiting on an empty queue does."""

    def __init__(self, pending: Pending, timeout_s: float) -> None:
        self.pending = pending
        self.timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None
        """When the wait in progress began; None while the consumer is not waiting."""
        self._timer = self._loop.call_later(timeout_s, self._check)

    async def next(self) -> OrchOutput | None:
        queue = self.pending.queue
        if queue.empty():
            self._since = self._loop.time()
            try:
                out = await queue.get()
            finally:
                self._since = None
        else:
            out = queue.get_nowait()
        return None if out is _IDLE else out

    def close(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        now, since = self._loop.time(), self._since
        if since is None:  # not waiting: no wait can end before a full timeout from now
            self._timer = self._loop.call_at(now + self.timeout_s, self._check)
        elif now < since + self.timeout_s:
            self._timer = self._loop.call_at(since + self.timeout_s, self._check)
        elif self.pending.queue.empty():  # else an output is on its way to the waiter
            self.pending.queue.put_nowait(_IDLE)
        else:
            self._timer = self._loop.call_at(now + self.timeout_s, self._check)


class Inbox:
    """`deliver` each output read; it returns what the client must abort upstream."""

    def __init__(
        self, metrics: Metrics, buffer_limit: int, recent_s: float = keys.RECENT_ABORTS_S
    ) -> None:
        self.metrics = metrics
        self.buffer_limit = buffer_limit
        self.recent_s = recent_s
        self.requests: dict[str, Pending] = {}
        self._recent: OrderedDict[str, tuple[float, str | None]] = OrderedDict()
        """request id → when the client let it go, and the error it had ended with (oldest
        first)."""

    def open(self, request_id: str) -> Pending:
        pending = self.requests[request_id] = Pending()
        return pending

    def close(self, request_id: str, now: float) -> None:
        """The consumer is done with it; late outputs for it drop quietly for a while."""
        pending = self.requests.pop(request_id, None)
        if pending is not None and (not pending.ended or pending.error is not None):
            self._remember(request_id, now, pending.error)

    def deliver(self, msg: OrchOutputView, now: float) -> str | None:
        """Queue `msg` for its request; the error to abort the request upstream with, if the
        client just ended it (a gap, or a full buffer)."""
        self._forget_old(now)
        rid = msg.request_id
        pending = self.requests.get(rid)
        if pending is None or pending.ended:
            recent = self._recent.get(rid)
            why = "ended" if pending is not None or recent is not None else "unknown"
            self.metrics.inc("omni_dropped_outputs_total", source="client", reason=why)
            ended_with = pending.error if pending is not None else recent and recent[1]
            if msg.finished and msg.error is None and ended_with:
                self._late_success(rid, ended_with)
            return None
        if msg.seq < pending.next_seq:
            self.metrics.inc("omni_duplicate_outputs_total", source="client")
            return None
        if msg.seq > pending.next_seq:
            self.metrics.inc("omni_outputs_lost_total")
            error = f"outputs lost: expected seq {pending.next_seq}, got {msg.seq}"
            return self.end(rid, msg.stage_id, error, now)
        pending.next_seq += 1
        if not msg.finished and pending.queue.qsize() >= self.buffer_limit:
            self.metrics.inc("omni_aborts_total", reason="client buffer full")
            error = (
                f"client buffer full: more than {self.buffer_limit} outputs not read "
                "(OMNI_CLIENT_BUFFER_OUTPUTS)"
            )
            return self.end(rid, msg.stage_id, error, now, drop_buffered=True)
        usage = TokenUsage.read(msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens)
        out = OrchOutput(rid, msg.stage_id, msg.data, msg.finished, msg.error, msg.error_code)
        out.finish_reason, out.usage = msg.finish_reason, usage
        pending.queue.put_nowait(out)
        pending.ended = msg.finished
        pending.error = msg.error
        return None

    def end(
        self, rid: str, stage_id: int, error: str, now: float, drop_buffered: bool = False
    ) -> str | None:
        """End a waiting request with one error final; the error, or None if it had ended."""
        pending = self.requests.get(rid)
        if pending is None or pending.ended:
            return None
        if drop_buffered:
            pending.queue = asyncio.Queue()  # the reader takes the new queue: memory freed
        pending.queue.put_nowait(OrchOutput(rid, stage_id, None, True, error=error))
        pending.ended, pending.error = True, error
        self._remember(rid, now, error)
        return error

    def end_all(self, error: str, now: float) -> list[str]:
        """End every waiting request with `error`; the ids of those it ended."""
        return [rid for rid in list(self.requests) if self.end(rid, 0, error, now) is not None]

    def _late_success(self, rid: str, ended_with: str) -> None:
        """A success final for a request already ended with an error: the user was told it
        failed. Only a gap (`outputs lost`) may rightly come before one; counted by the
        error's kind (`omni_late_successes_total`)."""
        kind = ended_with.split(":", 1)[0]
        self.metrics.inc("omni_late_successes_total", reason=kind)
        log.warning(
            "request %r: a success final arrived after it ended with %r",
            rid,
            ended_with,
            extra={"request_id": rid},
        )

    def _remember(self, rid: str, now: float, error: str | None = None) -> None:
        self._recent[rid] = (now, error)
        self._recent.move_to_end(rid)

    def _forget_old(self, now: float) -> None:
        while self._recent:
            rid, (at, _error) = next(iter(self._recent.items()))
            if now - at < self.recent_s:
                return
            del self._recent[rid]
