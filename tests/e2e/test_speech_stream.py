"""`/v1/audio/speech/stream` on the synthetic demo (workers/omni.yaml, streaming, as
processes, `serve` in front): text written in as a model writes it, speech back in order
before the text is done, several utterances on one socket, bad messages, a client gone."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import websockets
from websockets.typing import Subprotocol

from tests.e2e.realtime_deployment import KEY, LONG_TEXT, Deployment
from tests.e2e.test_realtime import expected_audio_s
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]

TEXT = "Hello there, this is a streamed sentence. And here comes another one, longer! Done?"


@dataclass
class Heard:
    events: list[dict[str, Any]] = field(default_factory=list)
    frames: list[tuple[int, int]] = field(default_factory=list)
    """(index of the event before it, bytes) of each binary frame."""
    first_audio_at: float | None = None

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]


def url(demo: Deployment, query: str = "") -> str:
    return demo.serve.url.replace("http://", "ws://") + "/v1/audio/speech/stream" + query


def connect(demo: Deployment, query: str = "") -> Any:
    return websockets.connect(
        url(demo, query), additional_headers={"Authorization": f"Bearer {KEY}"}
    )


async def listen(ws: Any, heard: Heard, until: str = "session.done", count: int = 1) -> None:
    """Take messages until `count` of kind `until` came (or the socket closed)."""
    try:
        async for m in ws:
            if isinstance(m, bytes):
                heard.frames.append((len(heard.events) - 1, len(m)))
                heard.first_audio_at = heard.first_audio_at or time.monotonic()
                continue
            heard.events.append(json.loads(m))
            if len(heard.of(until)) == count:
                return
    except websockets.ConnectionClosed:
        pass


async def write(ws: Any, text: str, every_s: float) -> float:
    """Word by word, as a model writes; returns when the last word went."""
    for word in text.split(" "):
        await ws.send(json.dumps({"type": "input.text", "text": word + " "}))
        await asyncio.sleep(every_s)  # a model's pace: the text must not come all at once
    return time.monotonic()


async def test_text_written_in_is_spoken_in_order_before_it_is_done(demo: Deployment) -> None:
    async with connect(demo) as ws:
        heard = Heard()
        listening = asyncio.create_task(listen(ws, heard))
        written_at = await write(ws, TEXT, 0.05)
        await ws.send(json.dumps({"type": "input.done"}))
        await asyncio.wait_for(listening, 30)
    assert heard.first_audio_at is not None and heard.first_audio_at < written_at  # early
    starts, dones = heard.of("audio.start"), heard.of("audio.done")
    assert "".join(s["sentence_text"] for s in starts) == TEXT  # every character but the last space
    assert [s["sentence_index"] for s in starts] == list(range(len(starts))) and len(starts) > 2
    assert heard.of("session.done") == [
        {"type": "session.done", "utterance_index": 0, "total_sentences": len(starts)}
    ]
    for start, done in zip(starts, dones, strict=True):
        assert (start["format"], start["sample_rate"]) == ("pcm", 24_000)
        assert done["error"] is False and done["sentence_index"] == start["sentence_index"]
        # the demo's 20 ms per letter of each token, as 16-bit samples at 24 kHz
        assert done["total_bytes"] == round(expected_audio_s(start["sentence_text"]) * 48_000)
    # one frame per piece, between its start and its done
    assert [heard.events[i]["type"] for i, _n in heard.frames] == ["audio.start"] * len(starts)
    assert [n for _i, n in heard.frames] == [d["total_bytes"] for d in dones]


async def test_utterances_follow_one_another_and_a_close_waits_for_the_speech(
    demo: Deployment,
) -> None:
    """With `stream_audio` each chunk is a frame as it is made; a config between two
    utterances changes the next; `session.close` ends the socket once all is spoken."""
    async with connect(demo, "?model=omni") as ws:
        await ws.send(json.dumps({"type": "session.config", "stream_audio": True}))
        heard = Heard()
        await ws.send(json.dumps({"type": "input.text", "text": "One utterance, then"}))
        await ws.send(json.dumps({"type": "input.text", "text": " its end."}))
        await ws.send(json.dumps({"type": "input.done"}))
        await listen(ws, heard)
        await ws.send(json.dumps({"type": "session.config", "voice": "low", "model": "omni"}))
        await ws.send(json.dumps({"type": "input.text", "text": "And a second one."}))
        await ws.send(json.dumps({"type": "session.close"}))
        await listen(ws, heard, count=2)
        await asyncio.wait_for(ws.wait_closed(), 10)
        assert ws.close_code == 1000
    assert heard.of("error") == []
    assert [d["utterance_index"] for d in heard.of("session.done")] == [0, 1]
    texts = [s["sentence_text"] for s in heard.of("audio.start")]
    assert "".join(texts) == "One utterance, then its end.And a second one."
    dones = heard.of("audio.done")
    assert sum(n for _i, n in heard.frames) == sum(d["total_bytes"] for d in dones)
    assert len(heard.frames) > len(dones)  # each chunk its own frame


async def test_a_bad_message_is_answered_and_the_session_goes_on(demo: Deployment) -> None:
    async with connect(demo) as ws:
        heard = Heard()
        for message in (
            "not json",
            {"type": "nope"},
            {"type": "session.config", "response_format": "mp3"},
            {"type": "session.config", "model": "another"},
            {"type": "input.text", "text": "Hello "},
            {"type": "session.config", "stream_audio": True},  # mid-utterance
            {"type": "input.done"},
        ):
            await ws.send(message if isinstance(message, str) else json.dumps(message))
        await listen(ws, heard)
    codes = [e["code"] for e in heard.of("error")]
    assert codes == ["invalid_message"] * 3 + ["model_fixed", "utterance_open"]
    assert [s["sentence_text"] for s in heard.of("audio.start")] == ["Hello "]
    assert heard.of("audio.done")[0]["error"] is False


async def test_a_model_that_does_not_read_text_aloud_or_a_wrong_key_is_refused(
    demo: Deployment,
) -> None:
    with pytest.raises(websockets.InvalidStatus) as missing:
        async with connect(demo, "?model=nope"):
            pass
    assert missing.value.response.status_code == 404
    with pytest.raises(websockets.InvalidStatus) as unkeyed:
        async with websockets.connect(url(demo)):
            pass
    assert unkeyed.value.response.status_code == 401
    # a browser, which cannot set headers on a WebSocket, sends its key as a subprotocol
    browser = [Subprotocol(f"openai-insecure-api-key.{KEY}")]
    async with websockets.connect(url(demo), subprotocols=browser) as ws:
        assert ws.subprotocol == browser[0]
        await ws.send(json.dumps({"type": "input.done"}))
        heard = Heard()
        await listen(ws, heard)
    assert heard.of("session.done") == [
        {"type": "session.done", "utterance_index": 0, "total_sentences": 0}
    ]


async def test_a_client_gone_mid_speech_is_dropped_by_every_stage(demo: Deployment) -> None:
    before = demo.stage_counts()
    async with connect(demo) as ws:
        await ws.send(json.dumps({"type": "input.text", "text": LONG_TEXT}))
        await ws.send(json.dumps({"type": "input.done"}))
        heard = Heard()
        await listen(ws, heard, until="audio.done")  # speaking: its next pieces are made
        wait_until(lambda: demo.stage_counts()[0].in_flight > 0, 10, demo.explain_stages)
    wait_until(lambda: demo.dropped_since(before), 10, demo.explain_stages)
