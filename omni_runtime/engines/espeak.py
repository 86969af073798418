"""espeak-ng (a formant synthesiser: no model, robotic but clear) as a one-stage vocoder from text.

It speaks each clause of the thinker's text (`text_chunks`) as soon as the clause is
complete, and streams within a clause too: espeak-ng hands its PCM to a callback every
`buflength_ms` of audio (100 ms: its first piece after ~0.3 ms), and each piece goes out
as a chunk (mono float32 in [-1, 1], 22,050 Hz) while the rest is still being made.
Returning 1 from that callback is how espeak-ng stops, so an aborted request stops
within one piece.

The library comes through ctypes: PyPI `espeakng-loader`'s build (it ships
`libespeak-ng` and its data), else the system's (Debian `libespeak-ng1`). Its state is
global, so a process holds one `Espeak` and synthesises one clause at a time; requests
take turns clause by clause (a clause takes ~1 ms per second of audio).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import queue
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised
from omni_runtime.engines.text_chunks import (
    DEFAULT_FIRST_CLAUSE_CHARS,
    DEFAULT_MAX_CLAUSE_CHARS,
    DEFAULT_MIN_CLAUSE_CHARS,
    request_clauses,
)
from omni_runtime.engines.voice_params import voice_params
from omni_runtime.errors import ConfigError
from omni_runtime.stage_api import Final, RequestRefused, marks_final

AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER = 1
CHARS_UTF8 = 0x1
ENDPAUSE = 0x1000
PARAM_RATE = 1
DEFAULT_RATE_WPM = 175
MIN_RATE_WPM = 80
"""espeak-ng's slowest rate: a slower `speed` is spoken at this rate."""
DEFAULT_VOICE = "en-us"
JOIN_TIMEOUT_S = 5.0
Pcm = npt.NDArray[np.float32]
_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)
_END = object()


def find_library() -> tuple[str, str | None] | None:
    """(library, data dir or None for its default): espeakng-loader's, else the system's."""
    if importlib.util.find_spec("espeakng_loader") is not None:
        import espeakng_loader

        return str(espeakng_loader.get_library_path()), str(espeakng_loader.get_data_path())
    system = ctypes.util.find_library("espeak-ng")
    return (system, None) if system else None


class Espeak:
    """espeak-ng loaded in this process: one synthesis at a time (`lock`)."""

    def __init__(self, buflength_ms: int, library: str | None = None, data_dir: str | None = None):
        if not 10 <= buflength_ms <= 1000:
            raise ConfigError("espeak: buflength_ms must be 10-1000")
        found = (library, data_dir) if library else find_library()
        if found is None:
            raise ConfigError(
                "espeak-ng is not installed: python3 -m pip install 'omni-runtime[espeak]' "
                "(or apt-get install libespeak-ng1)"
            )
        self.buflength_ms = buflength_ms
        self.library = found[0]
        self.lock = threading.Lock()
        self._lib: Any = ctypes.CDLL(found[0])
        self._lib.espeak_Initialize.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        self._lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self._lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._lib.espeak_Synth.argtypes = [
            ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        data = found[1].encode() if found[1] else None
        rate = self._lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, buflength_ms, data, 0)
        if rate <= 0:
            raise ConfigError(f"espeak: espeak_Initialize failed ({rate}) with {found}")
        self.sample_rate = int(rate)
        self._callback = _CALLBACK(self._on_audio)  # kept: espeak holds a pointer to it
        self._lib.espeak_SetSynthCallback(self._callback)
        self._sink: SynthStream | None = None
        self._voice: str | None = None

    def select_voice(self, name: str) -> None:
        """Make `name` (e.g. `en-us`; `en` is British) the voice; call with `lock` held."""
        if name != self._voice:
            if self._lib.espeak_SetVoiceByName(name.encode()) != 0:
                self._voice = None
                raise RequestRefused(
                    f"espeak: unknown voice {name!r} (try en-us, en, en-gb-x-rp, de, fr)",
                    "invalid_value",
                )
            self._voice = name

    def synth(self, text: str, voice: str, rate_wpm: int) -> SynthStream:
        """Start speaking `text` on a thread of its own; iterate the stream for its PCM."""
        stream = SynthStream(self, text, voice, rate_wpm)
        stream.start()
        return stream

    def run(self, stream: SynthStream) -> None:
        """Synthesise a stream's text; its PCM reaches it through the callback."""
        with self.lock:
            self.select_voice(stream.voice)
            self._lib.espeak_SetParameter(PARAM_RATE, stream.rate_wpm, 0)
            text = stream.text.encode()
            self._sink = stream
            try:
                err = self._lib.espeak_Synth(
                    text, len(text) + 1, 0, POS_CHARACTER, 0, CHARS_UTF8 | ENDPAUSE, None, None
                )
            finally:
                self._sink = None
        if err != 0 and not stream.stopped:
            raise RuntimeError(f"espeak: espeak_Synth failed ({err})")

    def _on_audio(self, wav: Any, num_samples: int, _events: Any) -> int:
        sink = self._sink
        if sink is None:
            return 1
        try:
            return sink.receive(wav, num_samples)
        except Exception:  # never let an exception unwind through C: stop instead
            return 1


class SynthStream:
    """One clause's PCM as espeak-ng makes it (an iterator); `close` stops it."""

    def __init__(self, engine: Espeak, text: str, voice: str, rate_wpm: int) -> None:
        self.engine = engine
        self.text = text
        self.voice = voice
        self.rate_wpm = rate_wpm
        self.samples = 0
        self.stopped = False
        """espeak-ng was told to stop (the callback returned 1)."""
        self.done_at: float | None = None
        """`time.perf_counter()` when synthesis returned (for tests and measurements)."""
        self._stop = threading.Event()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="espeak-synth", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def receive(self, wav: Any, num_samples: int) -> int:
        """From the callback, on the synthesis thread: 1 stops espeak-ng."""
        if self._stop.is_set():
            self.stopped = True
            return 1
        if num_samples > 0 and wav:
            pcm = np.ctypeslib.as_array(wav, shape=(num_samples,)).astype(np.float32) / 32768.0
            self.samples += num_samples
            self._queue.put(pcm)
        return 0

    def _run(self) -> None:
        try:  # the synthesis thread's failure, whatever it is, goes to the reader
            ran = foreign.call(self.engine.run, self)
            if isinstance(ran, Raised):
                self._queue.put(ran.error)
        finally:
            self.done_at = time.perf_counter()
            self._queue.put(_END)

    def __iter__(self) -> Iterator[Pcm]:
        while (item := self._queue.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item

    def close(self) -> None:
        """Stop synthesising (at espeak-ng's next piece) and wait until it has returned."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(JOIN_TIMEOUT_S)


_engine_lock = threading.Lock()
_engine: Espeak | None = None


def get_espeak(buflength_ms: int = 100, library: str | None = None) -> Espeak:
    """This process's espeak-ng (initialised once: another buffer length or library is a
    config error)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = Espeak(buflength_ms, library)
        elif (_engine.buflength_ms, _engine.library) != (buflength_ms, library or _engine.library):
            raise ConfigError(
                f"espeak: initialised with buflength_ms={_engine.buflength_ms} and "
                f"{_engine.library}; one process cannot also use {buflength_ms} and {library}"
            )
        return _engine


def rate_wpm(speed: float) -> int:
    """espeak-ng's words per minute for a speed (1.0: its default 175; at least 80)."""
    return max(MIN_RATE_WPM, round(DEFAULT_RATE_WPM * speed))


@marks_final
def vocoder(
    data: Any,
    *,
    voice: str = DEFAULT_VOICE,
    voices: dict[str, str] | None = None,
    speed: float = 1.0,
    buflength_ms: int = 100,
    min_clause_chars: int = DEFAULT_MIN_CLAUSE_CHARS,
    max_clause_chars: int = DEFAULT_MAX_CLAUSE_CHARS,
    first_clause_chars: int | None = DEFAULT_FIRST_CLAUSE_CHARS,
    library: str | None = None,
    params: dict[str, Any] | None = None,
) -> Generator[Any, None, None]:
    """Text deltas (a prompt string, or the thinker's str chunks) → PCM chunks, streamed.

    `voice`: an espeak-ng voice name; `voices` maps other names (an API's) to one.
    """
    chosen = voice_params(params, voice, speed, voices or {})
    name = chosen.voice or DEFAULT_VOICE
    name = (voices or {}).get(name, name)
    engine = get_espeak(buflength_ms, library)
    with engine.lock:
        engine.select_voice(name)  # an unknown voice fails here, before any work
    rate = rate_wpm(chosen.speed)
    clauses = request_clauses(data, params, min_clause_chars, max_clause_chars, first_clause_chars)
    for clause, is_last in clauses:
        held: Pcm | None = None  # one piece back, to mark the request's last one
        if clause:
            stream = engine.synth(clause, name, rate)
            try:
                for pcm in stream:
                    if held is not None:
                        yield held
                    held = pcm
            finally:
                stream.close()
        if is_last:
            yield Final(held if held is not None else np.zeros(0, dtype=np.float32))
        elif held is not None:
            yield held
