"""`/v1/realtime`: the OpenAI Realtime API (GA) over Starlette's WebSocket support.

One socket is one session (`realtime_session.Session`), carried by a `sockets.Connection`
(its bounds, limits and drain). A malformed or unknown event gets one `error` event and
the session goes on.

The API key and a page's `Origin` are checked as for every WebSocket (`sockets`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, WebSocket

from omni_runtime.http.errors import ApiError
from omni_runtime.http.gateway import Gateway, Served
from omni_runtime.http.realtime_events import EventError, error_event, event, parse_client_event
from omni_runtime.http.realtime_session import Session
from omni_runtime.http.realtime_transcription import check_transcribes
from omni_runtime.http.sockets import (
    Connection,
    KeyCheck,
    Message,
    OriginCheck,
    RealtimeSettings,
    admit,
    offered_key,
    refuse,
)

PATH = "/v1/realtime"


def realtime_router(
    gateway: Gateway, check_key: KeyCheck, check_origin: OriginCheck, settings: RealtimeSettings
) -> APIRouter:
    router = APIRouter()

    @router.websocket(PATH)
    async def realtime(
        websocket: WebSocket, model: str | None = None, intent: str | None = None
    ) -> None:
        """`?intent=transcription`: a transcription session from the start."""
        offered, authorization = offered_key(websocket)
        subprotocol = "realtime" if "realtime" in offered else None
        if (cross_site := check_origin(websocket.headers)) is not None:
            await refuse(websocket, cross_site, realtime_error, subprotocol)
            return
        try:
            await check_key(authorization)
            served = _served(gateway, model)
            if intent == "transcription" and (why := check_transcribes(served)) is not None:
                raise ApiError(400, why, param="model", code="invalid_value")
            admit(gateway, settings)
        except ApiError as e:
            await refuse(websocket, e, realtime_error, subprotocol)
            return

        def session(emit: Callable[[Message], None], wake: Callable[[], None]) -> RealtimeSession:
            made = RealtimeSession(gateway, served, settings, emit, wake)
            if intent == "transcription":
                made.transcribing = "transcription"
            return made

        await Connection(gateway, websocket, settings, session).serve(subprotocol)

    return router


def _served(gateway: Gateway, model: str | None) -> Served:
    """The pipeline `?model=` names; without one, the first served that speaks or writes."""
    if model is not None:
        return gateway.model(model)
    return gateway.first


def realtime_error(message: str, code: str, server: bool = False) -> dict[str, Any]:
    """Realtime's `error` event (`server_error` when not the client's doing)."""
    kind = "server_error" if server else "invalid_request_error"
    return error_event(EventError(message, code, kind=kind))


class RealtimeSession(Session):
    """A Realtime session as a connection carries it (`sockets.SocketSession`)."""

    @property
    def busy(self) -> bool:
        return self.active is not None or bool(self.transcriptions)

    @property
    def finished(self) -> bool:
        return False

    def start(self) -> dict[str, Any]:
        return event("session.created", session=self.describe())

    def take(self, raw: str | bytes) -> None:
        event_id: str | None = None
        try:
            ev = parse_client_event(raw)
            event_id = ev.event_id
            self.handle(ev)
        except EventError as e:
            self.emit(error_event(e, event_id))

    def error(self, message: str, code: str, server: bool = False) -> dict[str, Any]:
        return realtime_error(message, code, server)
