"""Write audio outputs to a WAV file a player can open (stdlib `wave`, 16-bit PCM mono)."""

from __future__ import annotations

import wave
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt


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
