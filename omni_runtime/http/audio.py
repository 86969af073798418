"""Float32 PCM chunks → what HTTP clients play: 16-bit PCM, WAV (whole or streamed), base64;
and uploaded WAV files checked and re-written whole for a speech-to-text pipeline."""

from __future__ import annotations

import base64
import io
import struct
import wave
from typing import Any

import numpy as np
import numpy.typing as npt

MAX_CHUNK_SAMPLES = 16 * 1024 * 1024
"""A single audio output larger than this (~17 min at 16 kHz) is refused, not buffered."""

STREAMING_SIZE = 0xFFFFFFFF
"""RIFF and data sizes of a WAV whose length is not known yet: players read to the end."""


class AudioFormatError(ValueError):
    """An audio-stage output that is not mono float PCM, or an upload that is no PCM WAV."""


def as_pcm(data: Any) -> npt.NDArray[np.float32]:
    """One audio-stage output as a flat float32 array; refuses anything that is not numbers."""
    try:
        arr = np.asarray(data)
    except (TypeError, ValueError) as e:
        raise AudioFormatError(f"audio output is not an array: {e}") from e
    if arr.dtype.kind not in "fiu" or arr.ndim > 2:
        raise AudioFormatError(f"audio output must be numeric PCM, got {arr.dtype} {arr.shape}")
    if arr.size > MAX_CHUNK_SAMPLES:
        raise AudioFormatError(f"audio output of {arr.size} samples exceeds {MAX_CHUNK_SAMPLES}")
    return arr.astype(np.float32, copy=False).reshape(-1)


def pcm16(samples: npt.NDArray[np.float32]) -> bytes:
    """Little-endian signed 16-bit, clipped: what OpenAI's `pcm16` / `pcm` formats carry."""
    clipped = np.clip(np.nan_to_num(samples, nan=0.0), -1.0, 1.0)
    return bytes(np.round(clipped * 32767).astype("<i2").tobytes())


def wav_header(sample_rate: int, data_bytes: int = STREAMING_SIZE) -> bytes:
    """A 44-byte mono 16-bit PCM WAV header; the default sizes say "until the stream ends"."""
    riff_size = STREAMING_SIZE if data_bytes == STREAMING_SIZE else 36 + data_bytes
    return b"".join(
        (
            b"RIFF",
            struct.pack("<I", riff_size),
            b"WAVEfmt ",
            struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16),
            b"data",
            struct.pack("<I", data_bytes),
        )
    )


def wav_bytes(pcm: bytes, sample_rate: int) -> bytes:
    """A complete WAV file around 16-bit PCM bytes."""
    return wav_header(sample_rate, len(pcm)) + pcm


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def whole_wav(data: bytes) -> bytes:
    """An uploaded WAV file as a stage can read it: integer PCM with at least one frame,
    re-written with its true sizes (a streamed WAV's header, as `/v1/audio/speech` sends
    it, says "until the end"); AudioFormatError for anything else."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            params = w.getparams()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError, struct.error) as e:
        raise AudioFormatError(f"not a PCM WAV file ({e or type(e).__name__})") from None
    frame_bytes = params.nchannels * params.sampwidth
    whole = len(frames) - len(frames) % frame_bytes
    if whole == 0:
        raise AudioFormatError("the WAV file holds no audio")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(params.nchannels)
        w.setsampwidth(params.sampwidth)
        w.setframerate(params.framerate)
        w.writeframes(frames[:whole])
    return out.getvalue()
