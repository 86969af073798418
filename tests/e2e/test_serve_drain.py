"""SIGTERM to `serve` while it streams an answer: it accepts nothing new, finishes the open
stream within its drain deadline (`OMNI_DRAIN_S`), then stops what it started and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from omni_runtime.local.launcher import redis_server_binary
from tests.e2e.raw_realtime import RawClient
from tests.e2e.serving import ServeProcess
from tests.services import unavailable
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]

DRAIN_S = 20.0
WORDS = 120
"""The demo thinks a word per 20 ms: an answer of seconds, still streaming at the SIGTERM."""


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.TransportError:
        return True
    return False


def test_sigterm_finishes_the_open_stream_and_refuses_new_work(tmp_path: Path) -> None:
    if redis_server_binary() is None:
        unavailable("no redis-server on PATH", "a redis-server")
    body = {
        "model": "omni",
        "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(WORDS))}],
        "stream": True,
    }
    with ServeProcess(
        tmp_path / "serve.log", "--pipeline", "workers/omni.yaml", env={"OMNI_DRAIN_S": "20"}
    ) as serve:
        lines: list[str] = []
        first = threading.Event()

        def read() -> None:
            with httpx.stream(
                "POST", f"{serve.url}/v1/chat/completions", json=body, timeout=60
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(30), serve.log()
        serve.proc.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        wait_until(lambda: refused(serve.url), 10)  # new connections go nowhere
        assert reader.is_alive() or lines[-1] == "data: [DONE]"  # the open one goes on
        reader.join(DRAIN_S)
        assert not reader.is_alive()
        assert lines[-1] == "data: [DONE]", (lines[-3:], serve.log())
        words = "".join(lines)
        assert f"w{WORDS - 1}" in words.lower(), serve.log()  # the whole answer
        assert serve.proc.wait(DRAIN_S + 15) == 0, serve.log()
        assert time.monotonic() - stopped_at < DRAIN_S + 15


def test_what_outlives_the_drain_ends_with_an_error_its_client_reads(tmp_path: Path) -> None:
    """A stream, a whole answer and a realtime response, still running when the drain ran
    out: each ends with OpenAI's error shape (`shutting_down`: an event in the stream begun,
    a 503, a failed `response.done` then close 1012), not a dropped connection, and `serve`
    exits 0 with no traceback logged."""
    if redis_server_binary() is None:
        unavailable("no redis-server on PATH", "a redis-server")
    words = " ".join(f"w{i}" for i in range(2000))  # ~40 s at a word per 20 ms
    with ServeProcess(
        tmp_path / "serve.log", "--pipeline", "workers/omni.yaml", env={"OMNI_DRAIN_S": "1"}
    ) as serve:
        url = f"{serve.url}/v1/chat/completions"
        lines: list[str] = []
        whole: list[httpx.Response] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "omni", "messages": [{"role": "user", "content": words}]}
            with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        first.set()

        def ask() -> None:
            body = {"model": "omni", "messages": [{"role": "user", "content": words}]}
            whole.append(httpx.post(url, json=body, timeout=60))

        readers = [threading.Thread(target=stream), threading.Thread(target=ask)]
        for reader in readers:
            reader.start()
        assert first.wait(30), serve.log()
        wait_until(lambda: b"w3" in b"".join(line.encode() for line in lines), 30)
        session = RawClient(serve.port, "")
        try:
            session.recv_until("session.created")
            answer_in_text(session, words)
            serve.proc.send_signal(signal.SIGTERM)
            done = session.recv_until("response.done", 30)["response"]
            assert done["status"] == "failed", done
            assert done["status_details"]["error"]["code"] == "shutting_down", done
            assert session.recv_until("error")["error"]["code"] == "shutting_down"
            assert session.close_code() == 1012
        finally:
            session.close()
        for reader in readers:
            reader.join(30)
            assert not reader.is_alive()
        assert '"code": "shutting_down"' in lines[-1], (lines[-3:], serve.log())
        assert whole[0].status_code == 503, whole[0].text
        assert whole[0].json()["error"]["code"] == "shutting_down"
        assert serve.proc.wait(15) == 0, serve.log()
        assert "Traceback" not in serve.log() and "3 request(s) still in flight cut" in serve.log()


def answer_in_text(session: RawClient, text: str) -> None:
    """Ask a realtime session for a text answer to `text`; return once it has begun."""
    session.send({"type": "session.update", "session": {
        "type": "realtime", "output_modalities": ["text"],
        "audio": {"input": {"turn_detection": None}},
    }})  # fmt: skip
    session.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}],
    }})  # fmt: skip
    session.send({"type": "response.create"})
    session.recv_until("response.output_text.delta", 30)


def test_sigterm_lets_a_realtime_response_end_then_closes_its_session(tmp_path: Path) -> None:
    """uvicorn would close every WebSocket at once (1012): `serve` holds its shutdown back
    until the realtime sessions' responses are done. A session with a response running
    gets it whole, then `shutting_down` and close 1012 (connect again); an idle one gets
    that at once; new connections are refused meanwhile; `serve` exits 0."""
    if redis_server_binary() is None:
        unavailable("no redis-server on PATH", "a redis-server")
    text = " ".join(f"w{i}" for i in range(WORDS))
    with ServeProcess(
        tmp_path / "serve.log", "--pipeline", "workers/omni.yaml", env={"OMNI_DRAIN_S": "20"}
    ) as serve:
        talking, idle = RawClient(serve.port, ""), RawClient(serve.port, "")
        try:
            for session in (talking, idle):
                session.recv_until("session.created")
            answer_in_text(talking, text)
            serve.proc.send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()

            said = idle.recv_until("error")["error"]
            assert (said["code"], said["type"]) == ("shutting_down", "server_error"), said
            assert idle.close_code() == 1012
            wait_until(lambda: refused(serve.url), 10)
            done = talking.recv_until("response.done", DRAIN_S)
            assert done["response"]["status"] == "completed", done
            said = done["response"]["output"][0]["content"][0]["text"]
            assert f"w{WORDS - 1}" in said.lower(), said[-80:]  # the whole answer
            assert talking.recv_until("error")["error"]["code"] == "shutting_down"
            assert talking.close_code() == 1012
        finally:
            talking.close()
            idle.close()
        assert serve.proc.wait(15) == 0, serve.log()
        assert time.monotonic() - stopped_at < DRAIN_S, serve.log()
        assert "Traceback" not in serve.log()


def test_a_speech_stream_is_spoken_to_its_end_then_closed_with_a_restart(
    tmp_path: Path,
) -> None:
    """A speech stream whose utterance is still being spoken at the SIGTERM gets all of it,
    then the drain's `error` and close 1012 (connect again)."""
    if redis_server_binary() is None:
        unavailable("no redis-server on PATH", "a redis-server")
    text = " ".join(f"word{i}" for i in range(WORDS)) + "."
    with ServeProcess(
        tmp_path / "serve.log", "--pipeline", "workers/omni.yaml", env={"OMNI_DRAIN_S": "20"}
    ) as serve:

        async def speak() -> tuple[list[dict[str, Any]], int | None]:
            url = serve.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
            events: list[dict[str, Any]] = []
            async with websockets.connect(url) as ws:
                await ws.send(json.dumps({"type": "input.text", "text": text}))
                await ws.send(json.dumps({"type": "input.done"}))
                with contextlib.suppress(websockets.ConnectionClosedError):  # 1012
                    async for m in ws:
                        if isinstance(m, str):
                            events.append(json.loads(m))
                            if len(events) == 1:  # speaking: the drain begins now
                                serve.proc.send_signal(signal.SIGTERM)
            return events, ws.close_code

        events, close_code = asyncio.run(speak())
        kinds = [e["type"] for e in events]
        assert kinds[-2:] == ["session.done", "error"], kinds
        assert events[-1]["code"] == "shutting_down" and close_code == 1012
        spoken = "".join(e["sentence_text"] for e in events if e["type"] == "audio.start")
        assert spoken == text  # every piece, none cut
        assert serve.proc.wait(DRAIN_S + 15) == 0, serve.log()
