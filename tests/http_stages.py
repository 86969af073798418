"""Stage code that shows the HTTP front door's prompts and parameters, for its tests.

`echo_request` says what stage 0 was given, `tone` speaks it in a voice and at a speed
a test can measure, `wav_duration` is a stand-in transcriber (it reports the WAV's length),
`parrot` a stand-in thinker that answers a transcript with itself, `dies_on` a request
that kills its worker.
"""

from __future__ import annotations

import io
import json
import os
import time
import wave
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from omni_runtime.core.tool_calls import ToolCall, calls_output
from omni_runtime.stage_api import Final, RequestRefused, marks_final

PARROT_SAYS = "I am a parrot: I say what I hear, word for word, and nothing else."
"""The parrot's answer after what it heard: ~4 s of speech, long enough to talk over."""
TONE_S = 0.1
"""A tone lasts this long at speed 1."""


def _sized(value: Any) -> str:
    """Bytes (a spoken turn's WAV) as their size: JSON has no bytes."""
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    raise TypeError(f"{type(value).__name__} is not JSON")


def echo_request(data: Any, params: dict[str, Any] | None = None) -> str | dict[str, Any]:
    """Stage 0 (text): its prompt and parameters, as one JSON text; when a call of a tool
    is required, a call of the tool named (or of the first) whose arguments are those."""
    said = json.dumps({"prompt": data, "params": params or {}}, sort_keys=True, default=_sized)
    params = params or {}
    if "tools" not in params or not ("tool_name" in params or params.get("tool_choice")):
        return said
    name = params.get("tool_name") or json.loads(params["tools"][0])["name"]
    return calls_output([ToolCall(name, said)])


def tone(
    data: Any,
    params: dict[str, Any] | None = None,
    sample_rate: int = 16000,
    voices: dict[str, float] | None = None,
) -> npt.NDArray[np.float32]:
    """An audio stage: a constant level per voice (`voices`; 0.1 with none given), lasting
    TONE_S / speed. An unknown voice is refused, as a real voice stage refuses it (the
    request's fault); the voice `crash` makes the stage itself fail (its own fault)."""
    for _chunk in data:  # the upstream's text (a list, or a ChunkStream when streaming)
        pass
    params = params or {}
    voice = params.get("voice")
    levels = voices or {}
    if voice == "crash":
        raise RuntimeError("the tone generator broke")
    if voice is not None and voice not in levels:
        raise RequestRefused(f"unknown voice {voice!r}", "invalid_value")
    level = levels[voice] if voice is not None else 0.1
    samples = round(sample_rate * TONE_S / float(params.get("speed", 1.0)))
    return np.full(samples, level, np.float32)


def wav_duration(data: Any, params: dict[str, Any] | None = None) -> str:
    """A stand-in transcriber (stage 0 of an `input: audio` pipeline): what the WAV is."""
    with wave.open(io.BytesIO(data["wav"])) as w:
        seconds = w.getnframes() / w.getframerate()
        rate, channels = w.getframerate(), w.getnchannels()
    language = (params or {}).get("language", "-")
    return f"{seconds:.4f} s, {rate} Hz, {channels} ch, language {language}"


def wav_words(data: Any, params: dict[str, Any] | None = None) -> Iterator[Any]:
    """A stand-in transcriber that knows when it heard what: a word per half second of the
    WAV ("w0", "w1", …, each said over its first 0.4 s), four to a piece; timed pieces
    (`{"text", "start", "end", "words"?}`) when the request asks for `timestamps`."""
    with wave.open(io.BytesIO(data["wav"])) as w:
        count = int(w.getnframes() / w.getframerate() / 0.5)
    asked = (params or {}).get("timestamps") or []
    for first in range(0, count, 4):
        words: list[dict[str, Any]] = [{"word": f"w{i}", "start": i * 0.5, "end": i * 0.5 + 0.4}
                 for i in range(first, min(first + 4, count))]  # fmt: skip
        text = ("" if first == 0 else " ") + " ".join(w["word"] for w in words)
        if not asked:
            yield text
            continue
        piece: dict[str, Any] = {"text": text, "start": words[0]["start"], "end": words[-1]["end"]}
        if "word" in asked:
            piece["words"] = words
        yield piece


@marks_final
def parrot(data: Any) -> Iterator[Any]:
    """A stand-in thinker after a speech-to-text stage: answers with what it heard, word by
    word as an LLM streams (`data`: the transcript's chunks, a list or a ChunkStream)."""
    heard = "".join(str(c) for c in data if c).strip()
    words = f"You said: {heard or 'nothing'}. {PARROT_SAYS}".split(" ")
    for i, word in enumerate(words):
        piece = word if i == 0 else f" {word}"
        yield Final(piece) if i == len(words) - 1 else piece


def dies_on(data: Any, word: str = "die", delay_s: float = 0.0) -> str:
    """A stand-in for a request that crashes its worker (a model's segfault, the OOM
    killer): the process exits on a prompt holding `word`; any other is echoed. Each
    takes `delay_s` first, as a model's work would: others are in flight beside it."""
    text = json.dumps(data, sort_keys=True)
    time.sleep(delay_s)
    if word in text:
        os._exit(3)
    return text
