"""A WebSocket session's connection, whatever it speaks (`/v1/realtime`, a speech stream).

A reader takes client messages in order and a writer sends the session's messages, each
from a queue bounded in bytes (`OMNI_REALTIME_MAX_SEND_BYTES`): a client that stops reading
ends its session instead of growing the server's memory, and so does one whose socket
takes no message for `OMNI_REALTIME_SEND_TIMEOUT_S` (frozen, or gone without a reset: its
requests are not left running for it). A client's close frame or TCP reset ends the
session at once (uvicorn's sans-I/O protocol reports either as soon as it arrives). A
message larger than `OMNI_REALTIME_MAX_EVENT_BYTES` gets one `error` and the session goes
on. A session ends after `OMNI_REALTIME_MAX_SESSION_S`, or `OMNI_REALTIME_IDLE_TIMEOUT_S`
without a client message while nothing runs for it; ending, or the client going away,
aborts what runs. When the server drains, a session closes as soon as nothing runs for
it (its last messages flushed, then close 1012: connect again).

The API key is checked as the HTTP API checks it, from `Authorization: Bearer <key>`
or (what a browser can send) the subprotocol `openai-insecure-api-key.<key>`. A browser
gets no CORS check on a WebSocket: a page's `Origin` is checked (`OriginCheck`), so that
a site the user visits cannot talk to a server on their machine. A handshake is refused
with an HTTP answer where the server can send one (a bad key, an unknown model, too many
sessions), else with an `error` message and a close.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect, WebSocketState

from omni_runtime.http.errors import ApiError, shutting_down
from omni_runtime.http.gateway import Gateway, Run, Served

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 1.0
"""A close frame, or the last messages before it, a client does not take within this is
given up on."""
DRAINED = "the server is shutting down (OMNI_DRAIN_S)"
CLOSED = "closed by the client"
FINISHED = "finished"
FAILED = "an internal error, which the server's log tells"
"""A session's handling of an event raised what it does not expect: its state may be half
changed, so it ends (1011), and the other sessions go on."""
"""The session said all it had to and asked to close (a speech stream's `session.close`)."""

KEY_PROTOCOL = "openai-insecure-api-key."
KeyCheck = Callable[[str | None], Awaitable[None]]
OriginCheck = Callable[[Mapping[str, str]], ApiError | None]
"""Why a handshake's headers may not open a session (a web page's `Origin`), or None."""
Message = dict[str, Any] | bytes
"""A JSON message, or a binary frame (audio)."""


@dataclass(frozen=True, slots=True)
class RealtimeSettings:
    """What a WebSocket session takes of the settings (`Settings.part`, by the app)."""

    realtime_max_event_bytes: int
    realtime_max_buffer_s: float
    realtime_max_session_s: float
    realtime_idle_timeout_s: float
    realtime_max_send_bytes: int
    realtime_send_timeout_s: float
    realtime_max_sessions: int
    request_timeout_s: float


class SocketSession(Protocol):
    """What a connection needs of the session it carries."""

    @property
    def busy(self) -> bool:
        """Something runs for the client: the session neither idles out nor drains."""

    @property
    def finished(self) -> bool:
        """The session is done: the connection flushes it and closes (1000)."""

    def start(self) -> dict[str, Any] | None:
        """The session begins (on accept): its first message, if any (Realtime's
        `session.created`)."""

    def take(self, raw: str | bytes) -> None:
        """One client message (within the size bound); errors are the session's to send."""

    def error(self, message: str, code: str, server: bool = False) -> dict[str, Any]:
        """The session's `error` message (`server`: not the client's doing)."""

    def close(self) -> None:
        """The connection is over: abort what runs."""


class Outbox:
    """Messages waiting for the socket, bounded in bytes; `overflowed` ends the session."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.queued = 0
        self.overflowed = False
        self.overflow = asyncio.Event()
        """Set once: the writer may be stuck in a send the client never takes."""
        self._items: deque[str | bytes] = deque()
        self._ready = asyncio.Event()
        self._finished = False

    def finish(self) -> None:
        """Nothing more comes: `get` returns None once what is queued has been taken."""
        self._finished = True
        self._ready.set()

    def put(self, message: Message) -> None:
        if self.overflowed:
            return
        item = message if isinstance(message, bytes) else json.dumps(message, separators=(",", ":"))
        if self.queued + len(item) > self.max_bytes:
            self.overflowed = True  # the client is not reading: stop queueing for it
            self._items.clear()
            self.overflow.set()
            self._ready.set()
            return
        self.queued += len(item)
        self._items.append(item)
        self._ready.set()

    async def get(self) -> str | bytes | None:
        """The next message to send; None once the outbox has overflowed."""
        while not self._items and not self.overflowed and not self._finished:
            self._ready.clear()
            await self._ready.wait()
        if self.overflowed or not self._items:
            return None
        item = self._items.popleft()
        self.queued -= len(item)
        return item


def offered_key(websocket: WebSocket) -> tuple[list[str], str | None]:
    """The subprotocols a handshake offers, and its `Authorization`: the header, else the
    key a browser sends as the subprotocol `openai-insecure-api-key.<key>`."""
    offered = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",")]
    keyed = [p[len(KEY_PROTOCOL) :] for p in offered if p.startswith(KEY_PROTOCOL)]
    authorization = websocket.headers.get("authorization") or (
        f"Bearer {keyed[0]}" if keyed else None
    )
    return offered, authorization


def admit(gateway: Gateway, settings: RealtimeSettings) -> None:
    """A new session may open (ApiError: why not): the server is not draining, and holds
    fewer than `OMNI_REALTIME_MAX_SESSIONS`."""
    if gateway.stopping:
        raise shutting_down()
    if len(gateway.sessions) >= settings.realtime_max_sessions:
        gateway.metrics.inc("omni_requests_refused_total", reason="realtime sessions")
        raise ApiError(429, f"{settings.realtime_max_sessions} WebSocket sessions are "
                       "open (OMNI_REALTIME_MAX_SESSIONS); retry later",
                       code="too_many_sessions")  # fmt: skip


async def refuse(
    websocket: WebSocket, err: ApiError, error: Callable[[str, str], dict[str, Any]],
    subprotocol: str | None = None,
) -> None:  # fmt: skip
    """The HTTP answer when the server can send one (401, 404), else an `error` message."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        body = {"error": err.body.model_dump()}
        await websocket.send_denial_response(
            JSONResponse(body, status_code=err.status, headers=err.headers)
        )
        return
    await websocket.accept(subprotocol=subprotocol)
    code = err.body.code or ("invalid_api_key" if err.status == 401 else "refused")
    await websocket.send_text(json.dumps(error(err.body.message, code)))
    await websocket.close(code=1013 if err.status in (429, 503) else 1008)  # 1013: try later


SessionFactory = Callable[[Callable[[Message], None], Callable[[], None]], SocketSession]
"""Builds a session from `emit` (queue a message) and `wake` (the reader looks again: a
run ended, the session finished)."""


class Connection:
    def __init__(
        self,
        gateway: Gateway,
        websocket: WebSocket,
        settings: RealtimeSettings,
        make_session: SessionFactory,
    ) -> None:
        self.gateway, self.websocket = gateway, websocket
        self.settings = settings
        self.outbox = Outbox(self.settings.realtime_max_send_bytes)
        self.wake = asyncio.Event()
        """Set when the drain begins and when a run ends: the reader looks again."""
        self.session = make_session(self.outbox.put, self.wake.set)

    def drain(self) -> None:
        self.wake.set()

    async def serve(self, subprotocol: str | None = None) -> None:
        """Accept, counted among the server's sessions from before the accept (no await
        between the count's check and this), and run until the session ends."""
        self.gateway.sessions.add(self)
        try:
            await self.websocket.accept(subprotocol=subprotocol)
            await self._run()
        finally:
            self.gateway.sessions.discard(self)

    async def _run(self) -> None:
        metrics = self.gateway.metrics
        metrics.add_gauge("omni_realtime_sessions_open", 1)
        writer = asyncio.get_running_loop().create_task(self._write(), name="socket-writer")
        self.overflow_wait = asyncio.ensure_future(self.outbox.overflow.wait())
        why = CLOSED
        try:
            if (hello := self.session.start()) is not None:
                self.outbox.put(hello)
            why = await self._read(writer)
            if why in (DRAINED, FINISHED):  # what the session said reaches the client whole
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
        if why != CLOSED:
            log.info("%s session ended: %s", self.websocket.url.path, why)
            await self._close(why)

    async def _read(self, writer: asyncio.Task[bool]) -> str:
        """Client messages until the session ends; why it ended."""
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
            ended = FINISHED if self.session.finished else None
            if self.gateway.stopping and not self.session.busy:
                ended = DRAINED
            if ended is not None:
                if receiving is not None:
                    receiving.cancel()
                return ended
            if self.session.busy:
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
                return CLOSED
            if receiving not in done:
                if woken:
                    continue
                if loop.time() >= ends_at:
                    receiving.cancel()
                    return "session length limit (OMNI_REALTIME_MAX_SESSION_S)"
                if not self.session.busy:
                    receiving.cancel()
                    return "idle (OMNI_REALTIME_IDLE_TIMEOUT_S)"
                continue
            message, receiving = receiving.result(), None
            if message["type"] == "websocket.disconnect":
                return CLOSED
            idle_since = loop.time()
            if not self._take(message):
                return FAILED

    def _take(self, message: dict[str, Any]) -> bool:
        """Hand one client message to the session; False if it failed unexpectedly."""
        raw = message.get("text")
        if raw is None:
            raw = message.get("bytes") or b""
        limit = self.settings.realtime_max_event_bytes
        if len(raw) > limit:  # characters or bytes: either bounds the work
            message_too_large = f"the event exceeds {limit} bytes (OMNI_REALTIME_MAX_EVENT_BYTES)"
            self.outbox.put(self.session.error(message_too_large, "event_too_large"))
            return True
        try:
            self.session.take(raw)
        except Exception:  # a bug, not the client's doing: this session alone ends
            log.exception("%s session failed handling an event", self.websocket.url.path)
            self.gateway.metrics.inc("omni_contained_errors_total", where="a session's event")
            return False
        return True

    async def _write(self) -> bool:
        """Send queued messages until the outbox overflows (False) or a send is not taken
        within `realtime_send_timeout_s` (True): either way the client stopped reading."""
        timeout = self.settings.realtime_send_timeout_s
        while (item := await self.outbox.get()) is not None:
            try:
                async with asyncio.timeout(timeout):
                    if isinstance(item, bytes):
                        await self.websocket.send_bytes(item)
                    else:
                        await self.websocket.send_text(item)
            except TimeoutError:
                return True
        return False

    async def _close(self, why: str) -> None:
        """Say why, then close; a client that takes neither is left to the transport."""
        if self.websocket.client_state != WebSocketState.CONNECTED:
            return
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                if not self.outbox.overflowed and why != FINISHED:
                    if why in (DRAINED, FAILED):  # not the client's doing
                        code = "shutting_down" if why == DRAINED else "server_error"
                        err = self.session.error(f"session ended: {why}", code, True)
                    else:
                        err = self.session.error(f"session ended: {why}", "session_ended")
                    await self.websocket.send_text(json.dumps(err))
                await self.websocket.close(code=_close_code(why))
        except (TimeoutError, RuntimeError, OSError, WebSocketDisconnect):
            pass


def _close_code(why: str) -> int:
    """1012 (service restart: connect again) for the drain, 1011 for an internal error,
    1000 for a limit reached or a session finished, 1008 for a client that broke the
    rules."""
    if why == DRAINED:
        return 1012
    if why == FAILED:
        return 1011
    return 1000 if why == FINISHED or "limit" in why or "idle" in why else 1008


async def open_shielded(
    gateway: Gateway,
    served: Served,
    prompt: Any,
    audio: bool,
    params: dict[str, Any] | None,
    text_stage: int | None = None,
) -> Run:
    """`gateway.open` for a session's task, which its closing may cancel meanwhile: the
    submission finishes, and the request is aborted at once, not left running."""
    opening = asyncio.ensure_future(
        gateway.open(served, prompt, audio, params=params, text_stage=text_stage)
    )
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_close_when_open)
        raise


def _close_when_open(opening: asyncio.Future[Run]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()  # not ended: aborted at every stage
