"""Background responses (`background: true` on `/v1/responses`): answered at once,
`in_progress` (or `queued`, while the server runs `max_inflight` requests: it begins here
as one ends), the response runs on without its client. `GET /v1/responses/{id}` on any
replica says how it stands, `POST /v1/responses/{id}/cancel` on any replica stops it, and
one asked with `stream` too can be read again from any event
(`GET /v1/responses/{id}?stream=true&starting_after=N`), as OpenAI's clients resume.

Its state lives in the deployment's Redis beside the response kept (`response_store`):
- the kept response: written `in_progress` (or `queued`, then `in_progress`) before the
  answer is sent, then once more when it ends;
- its lease (`Names.background(id, "lease")`), renewed by the server running it: a
  response in progress whose lease lapsed was running on a server that stopped, and reads
  as failed (nothing else could end it);
- its end (`"end"`), set once (`SET NX`) by whichever comes first: the run ending (which
  then writes the response's last state), a cancel or a delete (which writes it, and
  aborts the run as a client that went away does). A cancel and an end that race leave
  one answer;
- a streamed one's events (`"events"`, a stream): one entry each, the entry's id its
  sequence number + 1, so a reader begins after any event; kept an hour after the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, cast

from fastapi.responses import StreamingResponse

from omni_runtime.core.tasks import cancel_and_wait
from omni_runtime.errors import OmniError
from omni_runtime.http.errors import ApiError
from omni_runtime.http.gateway import Gateway, Run
from omni_runtime.http.response_store import Kept, ResponseStore, unavailable
from omni_runtime.http.routes import GuardedStream
from omni_runtime.redis_io.clients import REDIS_FAILURES

log = logging.getLogger(__name__)

LEASE_MS = 10_000
"""A background response's lease: its server renews it three times as often; a response in
progress whose lease lapsed was running on a server that stopped."""
RENEW_S = LEASE_MS / 3000
QUEUED_LOOK_S = 1.0
"""A queued response looks this often whether a cancel or a delete on another replica ended
it (one here wakes it at once), and whether a place freed it was not woken for."""
EVENTS_TTL_S = 3600
"""A streamed background response's events can be read again this long after the last."""
FOLLOW_BLOCK_MS = 2000
"""A reader that waited this long for an event looks at the response itself: it may have
ended without its last events (Redis refused them), or its server may have stopped."""
ENDINGS = {"completed": "response.completed", "incomplete": "response.incomplete",
           "failed": "response.failed", "cancelled": "response.failed"}  # fmt: skip
"""A response's last event, by its status (a cancelled one has no event of its own)."""
RUNNING = ("queued", "in_progress")
Read = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]
"""What XREAD of one stream answers (RESP2)."""
ABORT_FAILURES: tuple[type[Exception], ...] = (OmniError, *REDIS_FAILURES)
CANCEL_REASON = "cancelled (POST /v1/responses/{id}/cancel)"
STOPPED = {"code": "server_error",
           "message": "the server running this response stopped before it ended"}  # fmt: skip


def sse(kind: str, seq: int, **fields: Any) -> bytes:
    """One server-sent event of the Responses API."""
    body = json.dumps({"type": kind, "sequence_number": seq, **fields})
    return f"event: {kind}\ndata: {body}\n\n".encode()


def ended_error(status: str) -> dict[str, str]:
    return {"code": status, "message": f"the response was {status} before it ended"}


class BackgroundState:
    """The Redis side of the background responses of one deployment."""

    def __init__(self, store: ResponseStore, key: Callable[[str, str], str]) -> None:
        """`key`: a response id's and a part's Redis name (`Names.background`)."""
        self.store, self.redis, self._key = store, store.redis, key

    @classmethod
    def of(cls, gateway: Gateway) -> BackgroundState:
        if gateway.kept is None:
            raise ApiError(503, "not ready: the server is starting", code="not_ready")
        return cls(gateway.kept, gateway.settings.names.background)

    async def begin(self, response_id: str, kept: Kept) -> None:
        """Its lease, then the response kept `in_progress`; a 503 if Redis cannot."""
        try:
            await self.renew(response_id)
            if not await self.store.keep(response_id, kept):
                raise ApiError(503, "the response cannot be kept: Redis refused it",
                               code="redis_unavailable")  # fmt: skip
        except REDIS_FAILURES as e:
            raise unavailable("the background response cannot begin", e) from e

    async def renew(self, response_id: str) -> None:
        await self.redis.set(self._key(response_id, "lease"), 1, px=LEASE_MS)

    async def release(self, response_id: str) -> None:
        await self.redis.delete(self._key(response_id, "lease"))

    async def end(self, response_id: str, status: str) -> bool:
        """True if this ends it (nothing did before): the caller writes its last state."""
        key = self._key(response_id, "end")
        return bool(await self.redis.set(key, status, nx=True, ex=max(self.store.ttl_s, 60)))

    async def ended_as(self, response_id: str) -> str | None:
        raw = await self.redis.get(self._key(response_id, "end"))
        return raw.decode() if isinstance(raw, bytes) else raw

    async def append(self, response_id: str, seq: int, event: bytes, kind: str) -> None:
        key = self._key(response_id, "events")
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(key, {"k": kind, "e": event}, id=f"{seq + 1}-0")
            pipe.expire(key, EVENTS_TTL_S)
            await pipe.execute()

    async def shown(self, kept: Kept) -> dict[str, Any]:
        """The response as it stands: one in progress whose server stopped is failed, one
        cancelled or deleted meanwhile is cancelled (its canceller writes that next)."""
        body = kept.response
        if not body.get("background") or body.get("status") not in RUNNING:
            return body
        response_id = body["id"]
        try:
            if await self.redis.exists(self._key(response_id, "lease")):
                return body
            ended = await self.ended_as(response_id)
            again = await self.store.get(response_id)  # its server writes it, then lets go
        except REDIS_FAILURES as e:
            raise unavailable("background responses cannot be read", e) from e
        if again is not None and again.response.get("status") not in RUNNING:
            return again.response
        if ended in ("cancelled", "deleted"):
            return {**body, "status": "cancelled"}
        return {**body, "status": "failed", "error": STOPPED}

    async def follow(self, response_id: str, after: int) -> AsyncIterator[bytes]:
        """Its events after the `after`th, as they come, up to its last; one that ended
        without its last event (or whose server stopped) gets it made from its state."""
        key, seq = self._key(response_id, "events"), after
        last: bytes | str = f"{after + 1}-0"
        while True:
            try:
                read = await self.redis.xread({key: last}, count=256, block=FOLLOW_BLOCK_MS)
                got = cast(Read, read)
            except REDIS_FAILURES as e:
                log.warning("background response %s: its events cannot be read: %r",
                            response_id, e)  # fmt: skip
                return  # the client reads again, after the last event it had
            for entry_id, fields in got[0][1] if got else ():
                last, seq = entry_id, int(entry_id.split(b"-")[0]) - 1
                yield fields[b"e"]
                if fields[b"k"].decode() in ENDINGS.values():
                    return
            if got:
                continue
            try:
                kept = await self.store.get(response_id)
                body = await self.shown(kept) if kept is not None else None
            except ApiError as e:
                log.warning("background response %s: %s", response_id, e.body.message)
                return
            if body is None or body["status"] not in RUNNING:
                if body is not None:
                    yield sse(ENDINGS[body["status"]], seq + 1, response=body)
                return


class Ending:
    """What a background run asks before it ends: whether it is the one to end it."""

    def __init__(self, state: BackgroundState, response_id: str) -> None:
        self.state, self.response_id = state, response_id
        self.won = False
        """The run set its end: what it writes last is the response's last state."""

    async def ends(self, status: str) -> bool:
        """True if the run ends the response as `status` (nothing ended it before)."""
        try:
            self.won = await self.state.end(self.response_id, status)
        except REDIS_FAILURES as e:
            raise unavailable("the background response cannot end", e) from e
        return self.won

    async def failed(self, error: dict[str, str]) -> tuple[str, dict[str, str], bool]:
        """(status, error, whether the run writes it): failed with `error`, unless a
        cancel or a delete ended it first."""
        if self.won:  # it failed after it ended (its conversation could not be written)
            return "failed", error, True
        try:
            if await self.state.end(self.response_id, "failed"):
                return "failed", error, True
            ended = await self.state.ended_as(self.response_id) or "failed"
        except REDIS_FAILURES as e:
            log.warning("background response %s: its end cannot be written: %r",
                        self.response_id, e)  # fmt: skip
            return "failed", error, False
        status = "cancelled" if ended in ("cancelled", "deleted") else ended
        return status, ended_error(status), False


def begin_run(
    gateway: Gateway,
    state: BackgroundState,
    response_id: str,
    events: AsyncIterator[bytes],
    stream: bool,
) -> None:
    """Run the response on, on this server, whatever its client does: each event kept for
    readers when it is `stream`ed; the lease renewed until it ends."""

    async def run() -> None:
        renewing = asyncio.create_task(_renewing(state, response_id))
        try:
            seq = 0
            async with aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    if stream:
                        await _appended(gateway, state, response_id, seq, event)
                    seq += 1
        finally:
            await cancel_and_wait([renewing])
            try:
                await state.release(response_id)
            except REDIS_FAILURES as e:  # it lapses by itself
                log.warning("background response %s: lease not released: %r", response_id, e)

    task = asyncio.get_running_loop().create_task(run())
    gateway.background.add(task)
    task.add_done_callback(gateway.background.discard)


async def placed(
    gateway: Gateway,
    state: BackgroundState,
    response_id: str,
    request_id: str,
    opener: Callable[[str], Awaitable[Run]],
) -> Run | None:
    """A queued response's run, opened once a place frees (the queued ones are woken as a
    run ends or one is stopped here, and look every `QUEUED_LOOK_S`); None if it was
    cancelled or deleted meanwhile. Raises what opening it raises, but for a place another
    took first (429: it waits on)."""
    while True:
        if response_id not in gateway.queued:  # cancelled or deleted here
            return None
        try:
            if await state.ended_as(response_id) is not None:
                return None
        except REDIS_FAILURES as e:  # its lease holds it: it waits on
            log.warning("background response %s: its end cannot be read: %r",
                        response_id, e)  # fmt: skip
        if gateway.inflight < gateway.serve.max_inflight:
            try:
                return await opener(request_id)
            except ApiError as e:
                if e.status != 429:
                    raise
        gateway.freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gateway.freed.wait(), QUEUED_LOOK_S)


def enqueue(gateway: Gateway, response_id: str) -> None:
    """Queued here; a 429 when the queue is full (as many as `max_inflight` wait)."""
    if len(gateway.queued) >= gateway.serve.max_inflight:
        gateway.metrics.inc("omni_requests_refused_total", reason="busy")
        raise ApiError(429, f"{gateway.inflight} requests in flight and {len(gateway.queued)} "
                       "background responses queued; retry later", code="busy")  # fmt: skip
    gateway.queued.add(response_id)
    gateway.metrics.set_gauge("omni_background_queued", len(gateway.queued))


def dequeue(gateway: Gateway, response_id: str) -> None:
    """No longer queued here (it began, or was stopped: its place is free at once)."""
    gateway.queued.discard(response_id)
    gateway.metrics.set_gauge("omni_background_queued", len(gateway.queued))
    gateway.freed.set()


async def begun(state: BackgroundState, response_id: str, kept: Kept) -> None:
    """A queued response began: kept `in_progress` (if Redis refuses, it reads `queued`
    while it runs). A cancel or a delete that came as it began is written again after."""
    try:
        await state.store.keep(response_id, kept)
        ended = await state.ended_as(response_id)
        if ended == "deleted":
            await state.store.delete(response_id)
        elif ended == "cancelled":
            cancelled = {**kept.response, "status": "cancelled"}
            await state.store.keep(response_id, kept.model_copy(update={"response": cancelled}))
    except REDIS_FAILURES as e:
        log.warning("background response %s: not kept in progress: %r", response_id, e)


async def _renewing(state: BackgroundState, response_id: str) -> None:
    while True:
        await asyncio.sleep(RENEW_S)  # a lease's period, not a wait for a condition
        try:
            await state.renew(response_id)
        except REDIS_FAILURES as e:
            log.warning("background response %s: lease not renewed: %r", response_id, e)


async def _appended(
    gateway: Gateway, state: BackgroundState, response_id: str, seq: int, event: bytes
) -> None:
    kind = event.split(b"\n", 1)[0].removeprefix(b"event: ").decode()
    try:
        await state.append(response_id, seq, event, kind)
    except REDIS_FAILURES as e:  # its readers then read its end from the response kept
        log.warning("background response %s: event %d not kept: %r", response_id, seq, e)
        gateway.metrics.inc("omni_background_events_unkept_total")


def followed(
    gateway: Gateway,
    state: BackgroundState,
    response_id: str,
    after: int,
    headers: dict[str, str],
) -> StreamingResponse:
    """A response's events after the `after`th, as a client reads them (-1: all). Each
    reader holds a Redis connection while it waits: `max_inflight` of them at most (429)."""
    if gateway.followers >= gateway.serve.max_inflight:
        gateway.metrics.inc("omni_requests_refused_total", reason="busy")
        raise ApiError(429, f"{gateway.followers} background responses read; retry later",
                       code="busy")  # fmt: skip
    gateway.followers += 1

    def done() -> None:
        gateway.followers -= 1

    events = state.follow(response_id, after)
    return GuardedStream(events, done, media_type="text/event-stream", headers=headers)


async def stop(
    state: BackgroundState,
    kept: Kept,
    as_status: str,
    abort: Callable[[str, str], Awaitable[None]] | None,
) -> dict[str, Any] | None:
    """End a background response still running as `as_status` (`cancelled`, `deleted`):
    its state written, its run aborted. The response as it then stands, or None if it had
    ended already."""
    body = kept.response
    response_id = body["id"]
    try:
        if not await state.end(response_id, as_status):
            return None
        cancelled = {**body, "status": "cancelled"}
        if as_status == "cancelled":
            await state.store.keep(response_id, kept.model_copy(update={"response": cancelled}))
    except REDIS_FAILURES as e:
        raise unavailable("the background response cannot be cancelled", e) from e
    if abort is not None:
        try:
            await abort(response_id.removeprefix("resp_"), CANCEL_REASON)
        except ABORT_FAILURES as e:  # its run ends unkept: its end is written
            log.warning("background response %s: abort not sent: %r", response_id, e)
    return cancelled
