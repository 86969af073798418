"""Float32 PCM chunks → what HTTP clients play: 16-bit PCM at the rate its format promises,
whole WAV, MP3, FLAC or Ogg Opus files (OpenAI's file formats), MP3 and Opus streams as
they are encoded, base64."""

from __future__ import annotations

import base64
import importlib.util
import io
import struct
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import soxr

MAX_CHUNK_SAMPLES = 16 * 1024 * 1024
"""A single audio output larger than this (~17 min at 16 kHz) is refused, not buffered."""

STREAMING_SIZE = 0xFFFFFFFF
"""RIFF and data sizes of a WAV whose length is not known yet: players read to the end."""
PCM16_RATE = 24_000
"""OpenAI's raw formats (chat's `pcm16`, speech's `pcm`) are 24 kHz: what a client of
theirs plays them at, whatever rate the pipeline makes."""


class AudioFormatError(ValueError):
    """An audio-stage output that is not mono float PCM."""


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


class Resampler:
    """A request's audio, chunk by chunk, at `PCM16_RATE`: soxr's streaming resampler keeps
    its filter's state across chunks (no click at their edges); `flush` gives its tail."""

    def __init__(self, from_rate: int, to_rate: int = PCM16_RATE) -> None:
        self._stream = (
            None
            if from_rate == to_rate
            else soxr.ResampleStream(from_rate, to_rate, 1, dtype="float32", quality="HQ")
        )

    def __call__(self, samples: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        if self._stream is None:
            return samples
        out: npt.NDArray[np.float32] = self._stream.resample_chunk(samples)
        return out

    def flush(self) -> npt.NDArray[np.float32]:
        if self._stream is None:
            return np.zeros(0, np.float32)
        out: npt.NDArray[np.float32] = self._stream.resample_chunk(
            np.zeros(0, np.float32), last=True
        )
        return out


def resampled(samples: npt.NDArray[np.float32], from_rate: int) -> npt.NDArray[np.float32]:
    """A whole answer at `PCM16_RATE`."""
    resample = Resampler(from_rate)
    return np.concatenate([resample(samples), resample.flush()])


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


FileFormat = Literal["wav", "mp3", "flac", "opus"]
"""A whole answer as one file; MP3, FLAC and Opus are encoded by libsndfile (`soundfile`)."""
MEDIA_TYPES: dict[FileFormat, str] = {
    "wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "opus": "audio/ogg",
}  # fmt: skip
_ENCODINGS = {
    "mp3": ("MP3", "MPEG_LAYER_III", {8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000}),
    "flac": ("FLAC", "PCM_16", None),
    "opus": ("OGG", "OPUS", {8000, 12000, 16000, 24000, 48000}),
}  # fmt: skip
"""libsndfile's format and subtype for each, and the sample rates it encodes (else the
audio goes at `PCM16_RATE`, which both take)."""


def without_soundfile(what: str) -> str | None:
    """Why `what` cannot be coded here (soundfile is not installed), or None: said before a
    request runs, not when its audio is done."""
    if importlib.util.find_spec("soundfile") is not None:
        return None
    return f"{what} needs the soundfile package on the server (pip install 'omni-runtime[serve]')"


def unencodable(fmt: FileFormat) -> str | None:
    """Why this server cannot make `fmt` files, or None."""
    return None if fmt == "wav" else without_soundfile(fmt)


StreamFormat = Literal["mp3", "opus"]
"""What `EncodedStream` makes: libsndfile writes an Ogg Opus stream front to back, and an
MP3 one but for its first frame, which it rewrites when the file closes. FLAC's rewritten
header is what a decoder needs (libsndfile cannot read a FLAC of unknown length), and a
WAV's says its true sizes: those two come whole."""
MP3_STREAM_LEVEL = 0.5
"""libsndfile's compression level for a streamed MP3, at a constant bit rate (~80 kbit/s
at 22.05 kHz): without the first frame's tag, a decoder that reads no further than the
size's worth at the first frame's rate would cut a variable-rate stream short."""
OGG_PAGE_MS = 100.0
"""How much Opus audio an Ogg page holds, at most, in a stream: libsndfile's default
(about a second) would hold each second back until it is whole; 100 ms costs ~5 % more bytes."""
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # sndfile.h (libsndfile >= 1.1)


def _short_ogg_pages(file: Any) -> None:
    """`OGG_PAGE_MS` pages, by the command soundfile does not wrap (through its cffi
    handle); an older libsndfile or soundfile keeps its default pages."""
    import soundfile

    try:
        latency = soundfile._ffi.new("double*", OGG_PAGE_MS)
        size = soundfile._ffi.sizeof("double")
        soundfile._snd.sf_command(file._file, _SFC_SET_OGG_PAGE_LATENCY_MS, latency, size)
    except AttributeError:
        pass


class _Outgoing(io.RawIOBase):
    """What an encoder writes, taken as it comes (`take`). A write back into bytes already
    taken is dropped: what went out cannot be changed (MP3's rewritten first frame)."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = bytearray()
        self._taken = 0
        self._pos = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        end = self._taken + len(self._pending)
        if self._pos < self._taken:  # gone out already
            skip = min(size, self._taken - self._pos)
            view, self._pos = view[skip:], self._pos + skip
        if self._pos > end:
            raise OSError("an encoder seeked past the end of its stream")
        at = self._pos - self._taken
        self._pending[at : at + len(view)] = view
        self._pos += len(view)
        return size

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        end = self._taken + len(self._pending)
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: end}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        return b""  # an encoder reads nothing back from a stream

    def take(self) -> bytes:
        out = bytes(self._pending)
        self._taken += len(out)
        self._pending.clear()
        return out


class EncodedStream:
    """One answer's audio as an MP3 or Ogg Opus stream, its bytes handed out as each chunk
    is encoded (an encoder and its resampler keep their state across chunks). Not thread
    safe: one chunk at a time. `close` gives the stream's tail; an unclosed one frees its
    encoder when collected."""

    def __init__(self, rate: int, fmt: StreamFormat) -> None:
        import soundfile

        _container, subtype, rates = _ENCODINGS[fmt]
        self._resample = Resampler(rate) if rates is not None and rate not in rates else None
        self._out = _Outgoing()
        mp3 = {"bitrate_mode": "CONSTANT", "compression_level": MP3_STREAM_LEVEL}
        self._file = soundfile.SoundFile(
            self._out,
            "w",
            PCM16_RATE if self._resample else rate,
            1,
            subtype,
            format=_ENCODINGS[fmt][0],
            **(mp3 if fmt == "mp3" else {}),
        )
        if fmt == "opus":
            _short_ogg_pages(self._file)

    def encode(self, samples: npt.NDArray[np.float32]) -> bytes:
        """The stream's bytes that `samples` completed (may be none yet)."""
        if self._resample is not None:
            samples = self._resample(samples)
        if samples.size:
            self._file.write(np.frombuffer(pcm16(samples), "<i2"))
        return self._out.take()

    def close(self) -> bytes:
        """The rest: the resampler's and the encoder's tails."""
        if self._file.closed:
            return b""
        if self._resample is not None:
            tail = self._resample.flush()
            if tail.size:
                self._file.write(np.frombuffer(pcm16(tail), "<i2"))
        self._file.close()
        return self._out.take()


def audio_file(samples: npt.NDArray[np.float32], rate: int, fmt: FileFormat) -> bytes:
    """A whole answer as one `fmt` file."""
    if fmt == "wav":
        return wav_bytes(pcm16(samples), rate)
    import soundfile

    container, subtype, rates = _ENCODINGS[fmt]
    if rates is not None and rate not in rates:
        samples, rate = resampled(samples, rate), PCM16_RATE
    out = io.BytesIO()  # from the samples a WAV holds: a FLAC decodes to the WAV's very PCM
    soundfile.write(out, np.frombuffer(pcm16(samples), "<i2"), rate, subtype, format=container)
    return out.getvalue()
