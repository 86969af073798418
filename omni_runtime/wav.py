"""WAV files (stdlib `wave`): audio outputs written as one a player can open (16-bit PCM
mono), and why an uploaded one could not be read."""

from __future__ import annotations

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
