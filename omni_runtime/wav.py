"""WAV files (stdlib `wave`): audio outputs written as one a player can open (16-bit PCM
mono), and a recording given as input (an upload, a chat's speech, a `--prompt-file`)
checked and re-written whole, or refused with the reason in words."""

from __future__ import annotations

import io
import struct
import wave
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

MIN_RATE = 4_000
MAX_RATE = 384_000
"""The sample rates an uploaded recording may have: narrowband telephony to studio audio."""


def write_wav(path: str | Path, chunks: Sequence[npt.ArrayLike], sample_rate: int) -> int:
    """Write the chunks as one 16-bit PCM mono WAV; returns the number of frames written."""
    parts = [np.asarray(c, dtype=np.float32).reshape(-1) for c in chunks]
    audio = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
    pcm = np.round(np.clip(audio, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return int(pcm.size)


def wav_error(data: bytes, e: Exception) -> str:
    """Why `wave` could not read `data`, in words: its EOFError says nothing."""
    if not data:
        return "the file is empty"
    if isinstance(e, EOFError):
        return "the file ends within its header"
    return str(e) or type(e).__name__


class WavError(ValueError):
    """Input audio that is no integer-PCM WAV file with audio in it."""


def whole_wav(data: bytes) -> bytes:
    """A WAV file as a speech-to-text stage reads it: integer PCM, a sample rate in
    `MIN_RATE..MAX_RATE`, at least one frame, re-written with its true sizes (a streamed
    WAV's header, as `/v1/audio/speech` sends it, says "until the end"); else `WavError`."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            params = w.getparams()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError, struct.error) as e:
        raise WavError(f"not a PCM WAV file ({wav_error(data, e)})") from None
    if not MIN_RATE <= params.framerate <= MAX_RATE:
        raise WavError(
            f"the WAV file's sample rate is {params.framerate} Hz, outside {MIN_RATE}..{MAX_RATE}"
        )
    frame_bytes = params.nchannels * params.sampwidth
    whole = len(frames) - len(frames) % frame_bytes
    if whole == 0:
        raise WavError("the WAV file holds no audio")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(params.nchannels)
        w.setsampwidth(params.sampwidth)
        w.setframerate(params.framerate)
        w.writeframes(frames[:whole])
    return out.getvalue()
