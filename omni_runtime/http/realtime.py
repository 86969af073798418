"""`/v1/realtime`: the OpenAI Realtime API (GA) over Starlette's WebSocket support.

One socket is one session (`realtime_session.Session`): a reader takes client events
in order and a writer sends server events, each from a queue bounded in bytes
(`OMNI_REALTIME_MAX_SEND_BYTES`): a client that stops reading ends its session
instead of growing the server's memory, and so does one whose socket takes no event for
`OMNI_REALTIME_SEND_TIMEOUT_S` (frozen, or gone without a reset: its request is not left
running for it). A client's close frame or TCP reset ends the session at once (uvicorn's
sans-I/O protocol reports either as soon as it arrives). A malformed or unknown event gets one
`error` event and the session goes on; an event larger than
`OMNI_REALTIME_MAX_EVENT_BYTES` too. A session ends after
`OMNI_REALTIME_MAX_SESSION_S`, or `OMNI_REALTIME_IDLE_TIMEOUT_S` without a client
event while no response runs; ending, or the client going away, aborts its response.

The API key is checked as the HTTP API checks it, from `Authorization: Bearer <key>`
or (what a browser can send) the subprotocol `openai-insecure-api-key.<key>`. A browser
gets no CORS check on a WebSocket: a page's `Origin` is checked here (`OriginCheck`), so
that a site the user visits cannot talk to a server on their machine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect, WebSocketState

from omni_runtime.http.errors import ApiError, shutting_down
from omni_runtime.http.gateway import Gateway, Served
from omni_runtime.http.realtime_events import EventError, error_event, event, parse_client_event
from omni_runtime.http.realtime_session import RealtimeSettings, Session

log = logging.getLogger(__name__)

PATH = "/v1/realtime"
KEY_PROTOCOL = "openai-insecure-api-key."
CLOSE_TIMEOUT_S = 1.0
"""A close frame, or the last events before it, a client does not take within this is
given up on."""
DRAINED = "the server is shutting down (OMNI_DRAIN_S)"

KeyCheck = Callable[[str | None], Awaitable[None]]
OriginCheck = Callable[[Mapping[str, str]], ApiError | None]
"""Why a handshake's headers may not open a session (a web page's `Origin`), or None."""


class Outbox:
    """Server events waiting for the socket, bounded in bytes; `overflowed` ends the session."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.queued = 0
        self.overflowed = False
        self.overflow = asyncio.Event()
        """Set once: the writer may be stuck in a send the client never takes."""
        self._items: deque[str] = deque()
        self._ready = asyncio.Event()
        self._finished = False

    def finish(self) -> None:
        """Nothing more comes: `get` returns None once what is queued has been taken."""
        self._finished = True
        self._ready.set()

    def put(self, ev: dict[str, Any]) -> None:
        if self.overflowed:
            return
        text = json.dumps(ev, separators=(",", ":"))
        if self.queued + len(text) > self.max_bytes:
            self.overflowed = True  # the client is not reading: stop queueing for it
            self._items.clear()
            self.overflow.set()
            self._ready.set()
            return
        self.queued += len(text)
        self._items.append(text)
        self._ready.set()

    async def get(self) -> str | None:
        """The next event to send; None once the outbox has overflowed."""
        while not self._items and not self.overflowed and not self._finished:
            self._ready.clear()
            await self._ready.wait()
        if self.overflowed or not self._items:
            return None
        text = self._items.popleft()
        self.queued -= len(text)
        return text


def realtime_router(
    gateway: Gateway, check_key: KeyCheck, check_origin: OriginCheck, settings: RealtimeSettings
) -> APIRouter:
    router = APIRouter()

    @router.websocket(PATH)
    async def realtime(websocket: WebSocket, model: str | None = None) -> None:
        offered = [
            p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",")
        ]
        keyed = [p[len(KEY_PROTOCOL) :] for p in offered if p.startswith(KEY_PROTOCOL)]
        authorization = websocket.headers.get("authorization") or (
            f"Bearer {keyed[0]}" if keyed else None
        )
        subprotocol = "realtime" if "realtime" in offered else None
        if (cross_site := check_origin(websocket.headers)) is not None:
            await _refuse(websocket, cross_site, subprotocol)
            return
        try:
            await check_key(authorization)
            served = _served(gateway, model)
            if gateway.stopping:
                raise shutting_down()
            if len(gateway.sessions) >= settings.realtime_max_sessions:
                gateway.metrics.inc("omni_requests_refused_total", reason="realtime sessions")
                raise ApiError(429, f"{settings.realtime_max_sessions} Realtime sessions are "
                               "open (OMNI_REALTIME_MAX_SESSIONS); retry later",
                               code="too_many_sessions")  # fmt: skip
        except ApiError as e:
            await _refuse(websocket, e, subprotocol)
            return
        connection = Connection(gateway, served, websocket, settings)
        gateway.sessions.add(connection)  # counted from now: no await since the count
        try:
            await websocket.accept(subprotocol=subprotocol)
            await connection.run()
        finally:
            gateway.sessions.discard(connection)

    return router


def _served(gateway: Gateway, model: str | None) -> Served:
    """The pipeline `?model=` names; without one, the first served that speaks or writes."""
    if model is not None:
        return gateway.model(model)
    return gateway.first


async def _refuse(websocket: WebSocket, err: ApiError, subprotocol: str | None) -> None:
    """The HTTP answer when the server can send one (401, 404), else an `error` event."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        body = {"error": err.body.model_dump()}
        await websocket.send_denial_response(
            JSONResponse(body, status_code=err.status, headers=err.headers)
        )
        return
    await websocket.accept(subprotocol=subprotocol)
    code = err.body.code or ("invalid_api_key" if err.status == 401 else "refused")
    await websocket.send_text(json.dumps(error_event(EventError(err.body.message, code))))
    await websocket.close(code=1013 if err.status in (429, 503) else 1008)  # 1013: try later


class Connection:
    def __init__(
        self, gateway: Gateway, served: Served, websocket: WebSocket, settings: RealtimeSettings
    ) -> None:
        self.gateway, self.websocket = gateway, websocket
        self.settings = settings
        self.outbox = Outbox(self.settings.realtime_max_send_bytes)
        self.wake = asyncio.Event()
        """Set when the drain begins and when a response ends: the reader looks again."""
        self.session = Session(gateway, served, self.settings, self.outbox.put, self.wake.set)

    def drain(self) -> None:
        self.wake.set()

    async def run(self) -> None:
        metrics = self.gateway.metrics
        metrics.add_gauge("omni_realtime_sessions_open", 1)
        writer = asyncio.get_running_loop().create_task(self._write(), name="realtime-writer")
        self.overflow_wait = asyncio.ensure_future(self.outbox.overflow.wait())
        why = "closed by the client"
        try:
            self.outbox.put(event("session.created", session=self.session.describe()))
            why = await self._read(writer)
            if why == DRAINED:  # the response just done reaches the client whole
                self.outbox.finish()
                await asyncio.wait({writer}, timeout=CLOSE_TIMEOUT_S)
        except WebSocketDisconnect:
            pass
        finally:
            self.session.close()
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            self.overflow_wait.cancel()
            metrics.add_gauge("omni_realtime_sessions_open", -1)
        if why != "closed by the client":
            log.info("realtime session %s ended: %s", self.session.id, why)
            await self._close(why)

    async def _read(self, writer: asyncio.Task[bool]) -> str:
        """Client events until the session ends; why it ended."""
        self.waking = asyncio.ensure_future(self.wake.wait())
        try:
            return await self._read_until_ended(writer)
        finally:
            self.waking.cancel()

    async def _read_until_ended(self, writer: asyncio.Task[bool]) -> str:
        s = self.settings
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + s.realtime_max_session_s
        idle_since = loop.time()
        receiving: asyncio.Future[Any] | None = None
        while True:
            if self.gateway.stopping and self.session.active is None:
                if receiving is not None:
                    receiving.cancel()
                return DRAINED
            if self.session.active is not None:
                idle_since = loop.time()
            wake_at = min(ends_at, idle_since + s.realtime_idle_timeout_s)
            if receiving is None:
                receiving = asyncio.ensure_future(self.websocket.receive())
            done, _ = await asyncio.wait(
                {receiving, writer, self.overflow_wait, self.waking},
                timeout=max(0.0, wake_at - loop.time()), return_when=asyncio.FIRST_COMPLETED,
            )  # fmt: skip
            woken = self.waking in done
            if woken:
                self.wake.clear()
                self.waking = asyncio.ensure_future(self.wake.wait())
            if self.overflow_wait in done:
                receiving.cancel()
                return "the client did not read its events (OMNI_REALTIME_MAX_SEND_BYTES)"
            if writer in done:  # a send failed (the client is gone) or timed out
                receiving.cancel()
                if not writer.cancelled() and writer.exception() is None and writer.result():
                    timeout = self.settings.realtime_send_timeout_s
                    return (
                        f"the client took no event for {timeout:g} s (OMNI_REALTIME_SEND_TIMEOUT_S)"
                    )
                return "closed by the client"
            if receiving not in done:
                if woken:
                    continue
                if loop.time() >= ends_at:
                    receiving.cancel()
                    return "session length limit (OMNI_REALTIME_MAX_SESSION_S)"
                if self.session.active is None:
                    receiving.cancel()
                    return "idle (OMNI_REALTIME_IDLE_TIMEOUT_S)"
                continue
            message, receiving = receiving.result(), None
            if message["type"] == "websocket.disconnect":
                return "closed by the client"
            idle_since = loop.time()
            self._take(message)

    def _take(self, message: dict[str, Any]) -> None:
        raw = message.get("text")
        if raw is None:
            raw = message.get("bytes") or b""
        limit = self.settings.realtime_max_event_bytes
        event_id: str | None = None
        try:
            if len(raw) > limit:  # characters or bytes: either bounds the work
                raise EventError(
                    f"the event exceeds {limit} bytes (OMNI_REALTIME_MAX_EVENT_BYTES)",
                    code="event_too_large",
                )
            ev = parse_client_event(raw)
            event_id = ev.event_id
            self.session.handle(ev)
        except EventError as e:
            self.outbox.put(error_event(e, event_id))

    async def _write(self) -> bool:
        """Send queued events until the outbox overflows (False) or a send is not taken
        within `realtime_send_timeout_s` (True): either way the client stopped reading."""
        timeout = self.settings.realtime_send_timeout_s
        while (text := await self.outbox.get()) is not None:
            try:
                async with asyncio.timeout(timeout):
                    await self.websocket.send_text(text)
            except TimeoutError:
                return True
        return False

    async def _close(self, why: str) -> None:
        """Say why, then close; a client that takes neither is left to the transport."""
        if self.websocket.client_state != WebSocketState.CONNECTED:
            return
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                if not self.outbox.overflowed:
                    err = EventError(f"session ended: {why}", code="session_ended")
                    if why == DRAINED:  # not the client's doing
                        err = EventError(
                            f"session ended: {why}", "shutting_down", kind="server_error"
                        )
                    await self.websocket.send_text(json.dumps(error_event(err)))
                await self.websocket.close(code=_close_code(why))
        except (TimeoutError, RuntimeError, OSError, WebSocketDisconnect):
            pass


def _close_code(why: str) -> int:
    """1012 (service restart: connect again) for the drain, 1000 for a limit reached."""
    if why == DRAINED:
        return 1012
    return 1000 if "limit" in why or "idle" in why else 1008
