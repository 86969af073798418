"""WAV files (stdlib `wave`): audio outputs written as one a player can open (16-bit PCM
mono), and a recording given as input (an upload, a chat's speech, a `--prompt-file`)
checked and re-written whole, or refused with the reason in words. A recording in MP3,
FLAC or Ogg (Vorbis, Opus) is decoded into one first (`soundfile`, the `serve` extra)."""

from __future__ import annotations

import importlib.util
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
MAX_DECODED_BYTES = 64 * 1024 * 1024
"""The most PCM a compressed recording may decode to: the largest WAV an upload may be."""


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


def recording(data: bytes) -> bytes:
    """A recording as a speech-to-text stage reads it (`whole_wav`): a PCM WAV file as it
    is; an MP3, FLAC or Ogg file, or a float WAV, decoded into 16-bit PCM; else `WavError`."""
    if data[:4] == b"RIFF" or not data:
        try:
            return whole_wav(data)
        except WavError as unread:
            if not data or importlib.util.find_spec("soundfile") is None:
                raise
            try:
                return _decoded(data)  # a WAV `wave` cannot read (float, A-law) libsndfile may
            except WavError:
                raise unread from None
    return _decoded(data)


def _decoded(data: bytes) -> bytes:
    try:
        import soundfile
    except ImportError:
        raise WavError(
            "not a WAV file, and MP3, FLAC and Ogg need the soundfile package "
            "(pip install 'omni-runtime[serve]')"
        ) from None
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate, channels = f.samplerate, f.channels
            most = MAX_DECODED_BYTES // (2 * channels)
            pcm = f.read(frames=most + 1, dtype="int16", always_2d=True)
    except soundfile.LibsndfileError as e:
        raise WavError(f"not a WAV, MP3, FLAC or Ogg file ({e.error_string})") from None
    except (RuntimeError, TypeError, ValueError) as e:
        raise WavError(f"not a WAV, MP3, FLAC or Ogg file ({e})") from None
    if len(pcm) > most:
        raise WavError(f"the recording decodes to more than {MAX_DECODED_BYTES} bytes of audio")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise WavError(f"the recording's sample rate is {rate} Hz, outside {MIN_RATE}..{MAX_RATE}")
    if not len(pcm):
        raise WavError("the recording holds no audio")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())
    return whole_wav(out.getvalue())  # its rate and length checked as a WAV's


def wav_seconds(wav: bytes) -> float:
    """How long a WAV file `recording` made lasts."""
    with wave.open(io.BytesIO(wav)) as w:
        return float(w.getnframes() / w.getframerate())
