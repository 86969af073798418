"""A WebSocket session whose handling of an event raises what nothing expected (a bug):
that session alone ends, its client told why (`server_error`, close code 1011), and the
server counts it; a Starlette WebSocket on an ASGI scope, as uvicorn hands one over."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, MutableMapping
from typing import Any

import pytest
from starlette.websockets import WebSocket

from omni_runtime.http.realtime import RealtimeSession
from omni_runtime.http.realtime_events import ClientEvent
from omni_runtime.http.sockets import Connection, Message, RealtimeSettings
from tests.integration.http_support import (
    fake_redis_clients,
    fast_settings,
    pipeline_of,
    serving,
)

pytestmark = pytest.mark.timeout(60)


class FailingOnCommit(RealtimeSession):
    """A session with a fault put in: committing the input buffer raises."""

    def handle(self, ev: ClientEvent) -> None:
        if ev.type == "input_audio_buffer.commit":
            raise RuntimeError("a fault put in for the test")
        super().handle(ev)


async def test_an_event_a_session_fails_on_ends_that_session_alone() -> None:
    async with serving([pipeline_of("echo")], fake_redis_clients(), fast_settings()) as (
        _client,
        gateway,
    ):
        incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        incoming.put_nowait({"type": "websocket.connect"})  # Starlette's accept reads it
        sent: list[MutableMapping[str, Any]] = []
        for text in ('{"type": "input_audio_buffer.clear"}', '{"type": "nonsense"}',
                     '{"type": "input_audio_buffer.commit"}'):  # fmt: skip
            incoming.put_nowait({"type": "websocket.receive", "text": text})

        async def receive() -> dict[str, Any]:
            return await incoming.get()

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "websocket", "path": "/v1/realtime", "headers": [], "query_string": b"",
                 "scheme": "ws", "server": ("omni", 80)}  # fmt: skip
        websocket = WebSocket(scope, receive, send)
        settings = gateway.settings.part(RealtimeSettings)
        served = gateway.first

        def session(emit: Callable[[Message], None], wake: Callable[[], None]) -> FailingOnCommit:
            return FailingOnCommit(gateway, served, settings, emit, wake)

        await asyncio.wait_for(Connection(gateway, websocket, settings, session).serve(), 10)
    events = [json.loads(m["text"]) for m in sent if m["type"] == "websocket.send"]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["session.created", "input_audio_buffer.cleared", "error"], kinds
    assert events[2]["error"]["code"] == "unknown_event_type"  # the client's: it went on
    last = events[-1]["error"]
    assert (last["type"], last["code"]) == ("server_error", "server_error"), last
    assert "internal error" in last["message"]
    assert sent[-1] == {"type": "websocket.close", "code": 1011, "reason": ""}
    assert gateway.metrics.value("omni_contained_errors_total", where="a session's event") == 1
    assert not gateway.sessions
