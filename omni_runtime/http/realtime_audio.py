"""The Realtime session's audio formats: `audio/pcm` (16-bit PCM at 24 kHz, as it is) and
G.711, `audio/pcmu` (μ-law) and `audio/pcma` (A-law) at 8 kHz, what telephony carries (a
phone call bridged to the session). G.711 is coded by libsndfile (`soundfile`, the
`serve` extra); the session keeps its input as 24 kHz PCM16 whatever comes in, and the
pipeline's audio goes out resampled to the output format's rate."""

from __future__ import annotations

import io
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from omni_runtime.http.audio import PCM16_RATE, Resampler, pcm16, without_soundfile

AudioType = Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
G711_RATE = 8000
_SUBTYPES = {"audio/pcmu": "ULAW", "audio/pcma": "ALAW"}


def rate_of(kind: AudioType) -> int:
    return PCM16_RATE if kind == "audio/pcm" else G711_RATE


def described(kind: AudioType) -> dict[str, Any]:
    """A format as a session describes it: its type and rate."""
    return {"type": kind, "rate": rate_of(kind)}


def uncodable(kind: AudioType) -> str | None:
    """Why this server cannot take or make `kind` (said when the session asks), or None."""
    return None if kind == "audio/pcm" else without_soundfile(kind)


def _g711_to_pcm16(data: bytes, kind: AudioType) -> npt.NDArray[np.int16]:
    import soundfile

    samples, _rate = soundfile.read(
        io.BytesIO(data), dtype="int16", samplerate=G711_RATE, channels=1,
        subtype=_SUBTYPES[kind], format="RAW",
    )  # fmt: skip
    return np.asarray(samples, dtype=np.int16)


def _pcm16_to_g711(samples: npt.NDArray[np.int16], kind: AudioType) -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, samples, G711_RATE, _SUBTYPES[kind], format="RAW")
    return out.getvalue()


class InputDecoder:
    """A session's appended audio as 24 kHz PCM16 bytes, chunk by chunk (the resampler's
    state carried across them: no click where chunks meet; its few milliseconds of delay
    are the next chunk's)."""

    def __init__(self, kind: AudioType) -> None:
        self.kind = kind
        self._resample = None if kind == "audio/pcm" else Resampler(G711_RATE, PCM16_RATE)

    def __call__(self, data: bytes) -> bytes:
        """`data` as decoded from base64; ValueError for what is not whole PCM16 samples."""
        if self._resample is None:
            if len(data) % 2:
                raise ValueError("audio is not 16-bit samples (an odd byte count)")
            return data
        pcm = _g711_to_pcm16(data, self.kind).astype(np.float32) / np.float32(32768)
        return pcm16(self._resample(pcm))


class OutputEncoder:
    """A response's audio in the session's output format: the pipeline's samples at
    `from_rate`, resampled to the format's rate and coded; `flush` gives the tail."""

    def __init__(self, kind: AudioType, from_rate: int) -> None:
        self.kind = kind
        self.rate = rate_of(kind)
        self._resample = Resampler(from_rate, self.rate)

    def __call__(self, samples: npt.NDArray[np.float32]) -> tuple[bytes, int]:
        """(the coded bytes, how many samples they hold)."""
        return self._coded(self._resample(samples))

    def flush(self) -> tuple[bytes, int]:
        return self._coded(self._resample.flush())

    def _coded(self, samples: npt.NDArray[np.float32]) -> tuple[bytes, int]:
        pcm = pcm16(samples)
        if self.kind == "audio/pcm" or not pcm:
            return pcm, len(pcm) // 2
        return _pcm16_to_g711(np.frombuffer(pcm, "<i2"), self.kind), len(pcm) // 2
