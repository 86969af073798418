"""Speech to text with CMU pocketsphinx (PyPI `pocketsphinx`, its bundled US English model).

A real speech-input stage for audio-in pipelines, offline, and the runtime's check that
synthesised speech is intelligible (TTS → 16 kHz → recognise → word error rate, `wer`).

Input: WAV bytes (PCM, any rate, mono or averaged channels), or `{"pcm": array or
bytes, "sample_rate": N}` (a float array in [-1, 1], an int16 array, or int16
little-endian bytes), or a list (or streamed `ChunkStream`) of those. Audio is
resampled to the model's 16 kHz (soxr). A conversation's turn with nothing to hear
(`{"wav": None, ...}`, `spoken_turn.py`) is heard as no words.
Output: the recognised text, one string (`transcribe`), or each segment's as it is
decoded (`transcribe_segments`, a generator stage: what `workers/transcribe.yaml` streams).

Audio is decoded in segments of at most `SEGMENT_SECONDS`, each cut at a pause and
decoded whole as soon as it has arrived (its cepstral mean taken from itself), after
the decoder's feature extraction is reset: the same audio is heard the same way
whatever a pooled decoder heard before. Fed piece by piece, pocketsphinx normalises by
a running mean it carries from one utterance to the next.

A decoder takes ~0.5 s to load and ~90 MB of memory, and serves one request at a
time; each process keeps the ones it made, at most `max_decoders` (4) per model, and
a request beyond them waits for one to be free (recognition is CPU-bound: more decoders
than cores would not finish sooner). A streamed request holds its decoder while its
audio arrives.
"""

from __future__ import annotations

import io
import re
import threading
import wave
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from omni_runtime.engines.spoken_turn import unspoken
from omni_runtime.errors import ConfigError
from omni_runtime.stage_api import ChunkStream, RequestRefused, marks_final
from omni_runtime.wav import MAX_RATE, MIN_RATE, wav_error

MODEL_RATE = 16_000
DEFAULT_MAX_SECONDS = 600.0
AUDIO = "invalid_audio"
"""The code audio this stage cannot hear is refused with (`RequestRefused`)."""
WORD_VARIANT = re.compile(r"\(\d+\)$")
"""The dictionary's mark of a word's other pronunciation, `read(2)`, not part of the word."""
DEFAULT_MAX_DECODERS = 4
SEGMENT_SECONDS = 8.0
"""The most audio decoded in one call. A call holds the GIL while it decodes, so its
length is bounded well inside a heartbeat's TTL (docs/engines.md); shorter segments
lose more words at their edges."""
PAUSE_SEARCH_SECONDS = 3.0
"""A segment ends at the quietest 100 ms of its last this many seconds."""
SEGMENT_BYTES = int(SEGMENT_SECONDS * MODEL_RATE) * 2
Floats = npt.NDArray[np.float32]
ModelKey = tuple[str | None, str | None, str | None]


@dataclass
class _Decoders:
    idle: list[Any] = field(default_factory=list)
    made: int = 0


_pool = threading.Condition()
_decoders: dict[ModelKey, _Decoders] = {}


@contextmanager
def _decoder(key: ModelKey, max_decoders: int) -> Iterator[Any]:
    """An idle decoder for this model, made if fewer than `max_decoders` exist, else the
    next one freed; back to the pool after."""
    with _pool:
        mine = _decoders.setdefault(key, _Decoders())
        _pool.wait_for(lambda: bool(mine.idle) or mine.made < max_decoders)
        decoder = mine.idle.pop() if mine.idle else None
        if decoder is None:
            mine.made += 1
    if decoder is None:
        loaded = False
        try:
            decoder = _load(key)
            loaded = True
        finally:
            if not loaded:  # a failed load frees its place
                with _pool:
                    mine.made -= 1
                    _pool.notify()
    try:
        yield decoder
    finally:
        with _pool:
            mine.idle.append(decoder)
            _pool.notify()


def _load(key: ModelKey) -> Any:
    from pocketsphinx import Config, Decoder

    config = Config(samprate=MODEL_RATE, loglevel="FATAL")
    for name, value in zip(("hmm", "lm", "dict"), key, strict=True):
        if value is not None:
            config[name] = value
    try:
        return Decoder(config)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"pocketsphinx: cannot load the model {key}: {e}") from e


def resample(audio: Floats, from_rate: int, to_rate: int) -> Floats:
    """soxr's resampler (it filters what the lower rate cannot hold, so nothing aliases)."""
    if from_rate == to_rate or audio.size == 0:
        return audio
    import soxr

    return np.asarray(soxr.resample(audio, from_rate, to_rate), dtype=np.float32)


def read_wav(data: bytes) -> tuple[Floats, int]:
    """A PCM WAV file's samples (float32 in [-1, 1], channels averaged) and rate."""
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as e:
        raise RequestRefused(f"not a PCM WAV file: {wav_error(data, e)}", AUDIO) from None
    if width == 1:
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        samples = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8  # sign-extend 24 bits
        samples = ints.astype(np.float32) / 8388608.0
    else:
        samples = np.frombuffer(raw, "<i4").astype(np.float32) / 2147483648.0
    return samples.reshape(-1, channels).mean(axis=1, dtype=np.float32), rate


def to_model_pcm(item: Any) -> bytes:
    """One input piece as the model reads it: 16 kHz mono int16 bytes."""
    if isinstance(item, dict) and isinstance(item.get("wav"), bytes):  # the HTTP upload
        item = item["wav"]
    if isinstance(item, bytes | bytearray | memoryview):
        audio, rate = read_wav(bytes(item))
    elif isinstance(item, dict) and "pcm" in item and "sample_rate" in item:
        audio, rate = _pcm_samples(item["pcm"]), item["sample_rate"]
    else:
        raise TypeError(
            "expected WAV bytes, {'wav': bytes} or {'pcm': array or bytes, 'sample_rate': int}, "
            f"got {type(item).__name__}"
        )
    if not isinstance(rate, int) or isinstance(rate, bool) or not MIN_RATE <= rate <= MAX_RATE:
        raise RequestRefused(
            f"sample_rate must be an int in {MIN_RATE}..{MAX_RATE}, got {rate!r}", AUDIO
        )
    pcm = resample(audio, rate, MODEL_RATE)
    return np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def _pcm_samples(pcm: Any) -> Floats:
    if isinstance(pcm, bytes | bytearray | memoryview):
        if len(pcm) % 2:
            raise RequestRefused("PCM bytes must be int16 samples (an even number of bytes)", AUDIO)
        return np.frombuffer(bytes(pcm), "<i2").astype(np.float32) / 32768.0
    if not isinstance(pcm, np.ndarray) or pcm.ndim not in (1, 2):
        raise TypeError("pcm must be int16 bytes or a 1-D (or samples x channels) numpy array")
    if pcm.dtype == np.int16:
        samples = pcm.astype(np.float32) / 32768.0
    elif np.issubdtype(pcm.dtype, np.floating):
        samples = pcm.astype(np.float32)
        if not np.all(np.isfinite(samples)):
            raise RequestRefused("pcm has NaN or infinite samples", AUDIO)
    else:
        raise TypeError(f"pcm arrays must be float or int16, got {pcm.dtype}")
    return samples if samples.ndim == 1 else samples.mean(axis=1, dtype=np.float32)


def transcribe(
    data: Any,
    *,
    hmm: str | None = None,
    lm: str | None = None,
    dictionary: str | None = None,
    max_seconds: float = DEFAULT_MAX_SECONDS,
    max_decoders: int = DEFAULT_MAX_DECODERS,
    language: str = "en",
    params: dict[str, Any] | None = None,
) -> str:
    """Speech (see the module doc) → its text. `hmm`, `lm`, `dictionary`: another model's
    files instead of the bundled `en-us` ones, `language` the one it hears. A request's
    `language` (`params`) other than that is refused: the model would hear another
    language's speech as wrong words of its own."""
    check_language(params, language)
    if unspoken(data):  # a conversation's turn with nothing to hear (`spoken_turn.py`)
        return ""
    model = (hmm, lm, dictionary)
    heard = _segments(data, model, max_seconds, max_decoders)
    return " ".join(h.text for h in heard if h.text)


@marks_final
def transcribe_segments(
    data: Any,
    *,
    hmm: str | None = None,
    lm: str | None = None,
    dictionary: str | None = None,
    max_seconds: float = DEFAULT_MAX_SECONDS,
    max_decoders: int = DEFAULT_MAX_DECODERS,
    language: str = "en",
    params: dict[str, Any] | None = None,
) -> Iterator[str | dict[str, Any]]:
    """`transcribe` as a generator stage: each segment's text goes out as soon as it is
    decoded (a streamed transcription's deltas), not the whole at the end; every piece but
    the first starts with a space, so the pieces joined are `transcribe`'s text. A request
    whose `params` ask for `timestamps` (`["segment"]`, `["segment", "word"]`: what
    `/v1/audio/transcriptions` asks for subtitles) gets each piece as `{"text", "start",
    "end"}` (seconds from the recording's start, of its first and last word), with
    `"words": [{"word", "start", "end"}, ...]` if asked."""
    check_language(params, language)
    if unspoken(data):
        return
    asked = (params or {}).get("timestamps")
    timed = isinstance(asked, list) and bool(asked)
    said = False
    for heard in _segments(data, (hmm, lm, dictionary), max_seconds, max_decoders):
        if not heard.text:
            continue
        text = f" {heard.text}" if said else heard.text
        said = True
        if not timed:
            yield text
            continue
        assert isinstance(asked, list)
        piece: dict[str, Any] = {"text": text, "start": heard.words[0][1],
                                 "end": heard.words[-1][2]}  # fmt: skip
        if "word" in asked:
            piece["words"] = [{"word": w, "start": a, "end": b} for w, a, b in heard.words]
        yield piece


def check_language(params: dict[str, Any] | None, language: str) -> None:
    """Refuse a request's `language` (ISO-639-1 as OpenAI's API takes it, or a tag such as
    `en-US`) that is not the model's."""
    asked = (params or {}).get("language")
    if asked is None:
        return
    if not isinstance(asked, str) or _primary(asked) != _primary(language):
        raise RequestRefused(
            f"language {asked!r}: this model hears {language!r} only", "unsupported_language"
        )


def _primary(tag: str) -> str:
    return tag.replace("_", "-").split("-")[0].strip().lower()


@dataclass(frozen=True)
class Heard:
    """One segment as decoded: its text, and its words with their times (seconds from the
    recording's start)."""

    text: str
    words: list[tuple[str, float, float]]


def _segments(data: Any, model: ModelKey, max_seconds: float, max_decoders: int) -> Iterator[Heard]:
    """Each segment (its text perhaps empty) as it is decoded, with a pooled decoder."""
    if not 1 <= max_decoders <= 64 or not max_seconds > 0:
        raise ConfigError("pocketsphinx: max_decoders must be 1-64 and max_seconds > 0")
    limit = int(max_seconds * MODEL_RATE) * 2
    pieces = data if isinstance(data, ChunkStream | list | tuple) else [data]
    decoded = 0
    with _decoder(model, max_decoders) as decoder:
        pending = bytearray()
        at = 0.0  # where `pending` starts in the recording, in seconds
        for pcm in _model_pcm(pieces, limit, max_seconds):
            pending += pcm
            while len(pending) > SEGMENT_BYTES:
                cut = segment_end(pending)
                yield _decode(decoder, bytes(pending[:cut]), at)
                decoded += 1
                at += cut / 2 / MODEL_RATE
                del pending[:cut]
        if pending or not decoded:
            yield _decode(decoder, bytes(pending), at)


def segment_end(pcm: bytearray) -> int:
    """Where to end a segment: the middle of the quietest 100 ms in the last
    PAUSE_SEARCH_SECONDS before SEGMENT_SECONDS, in bytes."""
    frame = MODEL_RATE // 100  # 10 ms
    first = int((SEGMENT_SECONDS - PAUSE_SEARCH_SECONDS) * MODEL_RATE)
    window = np.frombuffer(pcm, "<i2", count=int(SEGMENT_SECONDS * MODEL_RATE))[first:]
    frames = window[: window.size // frame * frame].astype(np.float32).reshape(-1, frame)
    energy = np.convolve((frames**2).mean(axis=1), np.ones(10), "valid")
    return 2 * (first + (int(np.argmin(energy)) + 5) * frame)


def _decode(decoder: Any, pcm: bytes, at: float) -> Heard:
    """One segment, starting `at` seconds into the recording, decoded whole, as a fresh
    decoder would (`reinit_feat` drops what the feature extraction kept from earlier
    utterances)."""
    decoder.reinit_feat()
    decoder.start_utt()
    try:
        decoder.process_raw(pcm, False, True)
    finally:
        decoder.end_utt()
    hyp = decoder.hyp()
    if hyp is None or not hyp.hypstr:
        return Heard("", [])
    frame_s = 1 / int(decoder.config["frate"])
    words = [
        (WORD_VARIANT.sub("", seg.word), round(at + seg.start_frame * frame_s, 3),
         round(at + (seg.end_frame + 1) * frame_s, 3))
        for seg in decoder.seg() if not seg.word.startswith(("<", "["))
    ]  # fmt: skip
    return Heard(str(hyp.hypstr), words)


def _model_pcm(pieces: Iterable[Any], limit: int, max_seconds: float) -> Iterator[bytes]:
    """Each piece as the model reads it, refusing audio past `limit` bytes of it."""
    used = 0
    for piece in pieces:
        pcm = to_model_pcm(piece)
        used += len(pcm)
        if used > limit:
            raise RequestRefused(f"audio longer than max_seconds={max_seconds:g}", AUDIO)
        yield pcm
