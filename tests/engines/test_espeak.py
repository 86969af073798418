"""espeak-ng as a one-stage vocoder from text, streaming from its synthesis callback."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from omni_runtime.engines import espeak
from omni_runtime.errors import ConfigError
from omni_runtime.stage_api import ChunkStream, RequestAborted
from tests.engines.speech import SENTENCES, audio, token_deltas, unwrap

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("needs_espeak")]
RATE = 22_050
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 400  # ~20 minutes of speech


def speak(data: Any, **options: Any) -> list[Any]:
    return unwrap(espeak.vocoder(data, **options))


def test_text_deltas_come_out_as_pcm_chunks_of_buflength() -> None:
    pcm = speak([*token_deltas(SENTENCES), None])
    assert espeak.get_espeak().sample_rate == RATE
    assert all(p.dtype == np.float32 and p.ndim == 1 for p in pcm)
    assert max(p.size for p in pcm) <= RATE // 10 + 1  # 100 ms pieces
    whole = audio(pcm)
    assert 5.0 < whole.size / RATE < 15.0
    assert float(np.max(np.abs(whole))) <= 1.0 and float(np.std(whole)) > 0.02


def test_the_first_chunk_comes_while_espeak_is_still_synthesising() -> None:
    stream = espeak.get_espeak().synth(LONG_TEXT, "en-us", 175)
    pieces = iter(stream)
    try:
        first = next(pieces)
        assert stream.done_at is None, "the first piece waited for the whole synthesis"
        got_first = time.perf_counter()
        rest = sum(p.size for p in pieces)
    finally:
        stream.close()
    assert first.size > 0 and rest > 600 * RATE
    assert stream.done_at is not None and stream.done_at > got_first


def test_the_stage_speaks_a_clause_before_its_input_ends() -> None:
    text_in = ChunkStream()
    text_in.extend(token_deltas("Good morning to you all. And"), closed=False)
    chunks = espeak.vocoder(text_in)
    assert next(chunks).size > 0
    text_in.abort()
    with pytest.raises(RequestAborted):
        list(chunks)


def test_closing_a_synthesis_stops_espeak_at_its_next_piece() -> None:
    engine = espeak.get_espeak()
    full = engine.synth(LONG_TEXT, "en-us", 175)
    full_samples = sum(p.size for p in full)
    stream = engine.synth(LONG_TEXT, "en-us", 175)
    next(iter(stream))
    stream.close()
    assert stream.stopped and stream.done_at is not None
    assert stream.samples < full_samples / 4
    assert engine.lock.acquire(timeout=1.0)  # free for the next request
    engine.lock.release()


def test_a_closed_stage_leaves_espeak_free_for_the_next_request() -> None:
    chunks = espeak.vocoder(LONG_TEXT, max_clause_chars=10_000)
    next(chunks)
    chunks.close()
    assert audio(speak("Next request.")).size > RATE // 2


def test_speed_and_voice_come_from_the_request() -> None:
    normal = audio(speak(SENTENCES)).size
    fast = audio(speak(SENTENCES, params={"speed": 2.0})).size
    assert 0.4 < fast / normal < 0.65
    british = audio(speak(SENTENCES, params={"voice": "en"}))
    assert british.size != normal
    assert audio(speak("Hi.", voices={"alloy": "en-us"}, params={"voice": "alloy"})).size > 0
    with pytest.raises(ValueError, match="unknown voice 'nobody'"):
        speak("Hi.", params={"voice": "nobody"})
    # an OpenAI voice the stage does not map speaks in its own voice
    assert audio(speak(SENTENCES, params={"voice": "shimmer"})).size == pytest.approx(
        normal, rel=0.01
    )
    with pytest.raises(ValueError, match="speed"):
        speak("Hi.", params={"speed": 0})


def test_speeds_below_espeaks_slowest_rate_use_that_rate() -> None:
    assert espeak.rate_wpm(1.0) == 175 and espeak.rate_wpm(2.0) == 350
    assert espeak.rate_wpm(0.25) == espeak.MIN_RATE_WPM


def test_nothing_to_say_still_ends_the_request() -> None:
    assert [p.size for p in speak([None])] == [0]
    assert [p.size for p in speak("   ")] == [0]


def test_a_request_that_wants_no_audio_is_read_and_not_spoken() -> None:
    assert [p.size for p in speak(SENTENCES, params={"modalities": ["text"]})] == [0]


def test_one_process_uses_one_buffer_length() -> None:
    espeak.get_espeak()
    with pytest.raises(ConfigError, match="buflength_ms"):
        espeak.get_espeak(buflength_ms=20)
