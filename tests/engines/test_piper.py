"""Piper as talker (text deltas → phoneme ids per clause) and vocoder (ids → PCM), for real."""

from __future__ import annotations

import gc
import random
import threading
import tracemalloc
from typing import Any

import numpy as np
import pytest

from omni_runtime.engines import piper
from omni_runtime.engines.wer import wer
from omni_runtime.errors import ConfigError
from omni_runtime.stage_api import ChunkStream, Final, RequestAborted
from tests.engines.speech import MAX_WER, SENTENCES, audio, token_deltas, unwrap

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("needs_piper")]
RATE = 22_050


def talk(data: Any, **options: Any) -> list[dict[str, Any]]:
    return unwrap(piper.talker(data, **options))


def test_the_talker_sends_each_clause_as_soon_as_it_is_complete() -> None:
    stream = ChunkStream()
    stream.extend(token_deltas("Good morning to you all. It"), closed=False)
    chunks = piper.talker(stream)
    assert next(chunks)["text"] == "Good morning"  # a short first piece (first_clause_chars)
    assert next(chunks)["text"] == "to you all."  # the input is still open
    stream.extend([" rains", ".", None], closed=True)
    assert [c.data["text"] for c in chunks if isinstance(c, Final)] == ["It rains."]


def test_the_talker_gives_the_voices_phoneme_ids_for_each_clause() -> None:
    chunks = talk([*token_deltas(SENTENCES), None])
    assert [c["text"] for c in chunks] == [
        "The quick",  # the first piece short (first_clause_chars), each next one at most
        "brown fox jumps over the",  # twice as long, then clauses
        "lazy dog.",
        "Please call me back when you get home tonight.",
        "I would like a cup of coffee and a piece of cake,",
        "please.",
    ]
    symbols = piper.load_voice(with_session=False).config.num_symbols
    for c in chunks:
        ids = c["phoneme_ids"]
        assert len(ids) > len(c["text"]) / 2 and all(0 <= i < symbols for i in ids)
    spoken = [c["text"] for c in talk("A prompt string works too.")]
    assert " ".join(spoken) == "A prompt string works too."


def test_the_talker_holds_no_memory_for_what_it_said() -> None:
    """piper-tts 1.8's espeak-ng bridge lost each clause's result and ~1.3 KB each time the
    voice was set: ~4 KB a text, 1.7 MB of Python objects and 12 MB of memory over these
    3,000 (`piper._mend_espeak_bridge`)."""

    def resident_mb() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096 / 2**20

    words = [
        "the",
        "sea",
        "river",
        "city",
        "light",
        "music",
        "quiet",
        "green",
        "blue",
        "seven",
        "Paris",
        "London",
    ]
    rng = random.Random(1)
    texts = [" ".join(rng.choices(words, k=16)) + f", number {k}. And {k}!" for k in range(3500)]
    voice = piper.load_voice(with_session=False)
    for text in texts[:500]:  # espeak-ng's own tables and caches settle
        piper.phoneme_ids(voice, text)
    gc.collect()
    before_mb = resident_mb()
    tracemalloc.start()
    try:
        first = tracemalloc.take_snapshot()
        for text in texts[500:]:
            piper.phoneme_ids(voice, text)
        gc.collect()
        grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(first, "lineno"))
    finally:
        tracemalloc.stop()
    assert grown < 100_000, f"{grown} bytes of Python objects kept"
    assert resident_mb() - before_mb < 3, "the talker's memory grew"
    assert piper._leaked([tuple(["a", "b", True])]) == []  # a list that holds what it holds


def test_the_vocoder_makes_float32_pcm_in_range_for_each_clause() -> None:
    chunks = talk(SENTENCES)
    pcm = unwrap(piper.vocoder(chunks))
    assert len(pcm) >= len(chunks)
    assert all(p.dtype == np.float32 and p.ndim == 1 for p in pcm)
    whole = audio(pcm)
    assert 5.0 < whole.size / RATE < 15.0  # ~8 s of speech
    assert float(np.max(np.abs(whole))) <= 1.0 and float(np.std(whole)) > 0.02


def test_the_vocoder_gives_its_memory_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run returns the arena's extensions, and the heap is trimmed every few runs."""
    voice = piper.load_voice(with_session=True)
    session = voice.session
    assert isinstance(session, piper.GivesBack)
    shrinking = session.options.get_run_config_entry("memory.enable_memory_arena_shrinkage")
    assert shrinking == "cpu:0"
    given: list[Any] = []
    inner_run = session.session.run

    def run(*args: Any) -> Any:
        given.append(args[2])  # the run options it was given
        return inner_run(*args)

    monkeypatch.setattr(session.session, "run", run)
    trims: list[int] = []
    monkeypatch.setattr(piper, "_malloc_trim", trims.append)
    before = session._runs
    chunks = talk(SENTENCES)
    assert audio(unwrap(piper.vocoder(chunks))).size > 0
    runs = session._runs - before
    assert runs == len(given) >= len(chunks) - 1  # each clause with phonemes is one run
    assert all(options is session.options for options in given)
    assert trims == [0] * runs  # each run ran alone: the heap was trimmed after each
    kept = piper.load_voice(with_session=True, release_memory=False)
    assert kept is not voice and not isinstance(kept.session, piper.GivesBack)
    assert audio(unwrap(piper.vocoder(chunks, release_memory=False))).size > 0
    assert trims == [0] * runs  # the one that keeps its memory trims nothing


def test_runs_that_overlap_trim_the_heap_as_the_last_ends_or_every_few(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    both_in = threading.Barrier(2)
    first_out = threading.Event()

    class Session:
        def run(self, _names: Any, feed: Any, _options: Any) -> Any:
            both_in.wait(10)
            if feed == "second":  # ends after the first: the last one running
                first_out.wait(10)
            return feed

    trims: list[int] = []
    monkeypatch.setattr(piper, "_malloc_trim", trims.append)
    session = piper.GivesBack(Session())

    def run_first() -> None:
        session.run(None, "first")
        first_out.set()

    first = threading.Thread(target=run_first)
    first.start()
    assert session.run(None, "second") == "second"
    first.join(10)
    assert trims == [0]  # not as the first ended (the second still ran): as the last did
    monkeypatch.setattr(piper, "TRIM_EVERY", 3)  # the next first to end is the third run
    both_in = threading.Barrier(2)
    first_out.clear()
    trims.clear()
    first = threading.Thread(target=run_first)
    first.start()
    session.run(None, "second")
    first.join(10)
    assert trims == [0, 0]  # as the third run ended (every third), then as the last did


def test_long_clauses_come_in_pieces_of_at_most_max_chunk_ms() -> None:
    pcm = unwrap(piper.vocoder(talk(SENTENCES), max_chunk_ms=200))
    assert all(p.size <= RATE // 5 for p in pcm)
    assert sum(p.size == RATE // 5 for p in pcm) >= 20


def test_nothing_to_say_still_ends_the_request() -> None:
    assert talk([None]) == [{"text": "", "phoneme_ids": []}]
    assert [p.size for p in unwrap(piper.vocoder([{"text": "", "phoneme_ids": []}]))] == [0]
    assert [p.size for p in unwrap(piper.vocoder([]))] == [0]


def test_a_request_that_wants_no_audio_is_read_and_not_spoken() -> None:
    """A text chat of a pipeline that speaks (`modalities: ["text"]`): the talker takes its
    input to the end (its upstream's chunks read) and ends with nothing to say."""
    stream = ChunkStream()
    stream.extend([*token_deltas(SENTENCES), None], closed=True)
    text_only = {"modalities": ["text"]}
    assert unwrap(piper.talker(stream, params=text_only)) == [{"text": "", "phoneme_ids": []}]
    spoken = talk(SENTENCES, params={"modalities": ["text", "audio"]})
    assert len(spoken) > 1 and all(c["phoneme_ids"] for c in spoken)


def test_speed_shortens_the_speech() -> None:
    chunks = talk(SENTENCES)
    normal = audio(unwrap(piper.vocoder(chunks))).size
    fast = audio(unwrap(piper.vocoder(chunks, params={"speed": 2.0}))).size
    slow = audio(unwrap(piper.vocoder(chunks, speed=0.5))).size
    assert 0.4 < fast / normal < 0.75 and 1.6 < slow / normal < 2.5  # VITS: not exactly 1/2


def test_without_sampling_noise_the_same_text_gives_the_same_audio() -> None:
    chunks = talk("Remember the word banana.")
    first, again = (
        audio(unwrap(piper.vocoder(chunks, noise_scale=0.0, noise_w_scale=0.0))) for _ in range(2)
    )
    assert np.array_equal(first, again)
    noisy = [audio(unwrap(piper.vocoder(chunks))) for _ in range(2)]  # the voice's own noise
    assert not np.array_equal(noisy[0], noisy[1])
    for bad in (-0.1, 2.5, float("nan")):
        with pytest.raises(ConfigError, match="noise_scale must be 0-2"):
            unwrap(piper.vocoder(chunks, noise_scale=bad))


def test_a_request_can_name_the_voice_and_an_unknown_one_fails() -> None:
    model = str(piper.bundled_voice())
    for params in ({"voice": "joe"}, {"voice": "en_US-joe-medium"}, {"voice": "alloy"}):
        assert talk("Hi.", voices={"alloy": model}, params=params)[0]["text"] == "Hi."
    with pytest.raises(ValueError, match="unknown voice or speaker 'nobody'") as refused:
        talk("Hi.", voices={"alloy": model}, params={"voice": "nobody"})
    assert "its voices: ['alloy', 'en_US-joe-medium', 'joe']" in str(refused.value)  # the way out


def test_openai_voice_names_speak_in_the_stages_own_voice() -> None:
    """What OpenAI clients send by default works on a piper pipeline: not mapped in
    `voices`, an OpenAI name is the stage's voice (the same ids, the same audio)."""
    default = talk(SENTENCES)
    for name in ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse",
                 "marin", "cedar"):  # fmt: skip
        assert talk(SENTENCES, params={"voice": name}) == default
    said = audio(unwrap(piper.vocoder(default, params={"voice": "marin"}))).size
    assert said == pytest.approx(audio(unwrap(piper.vocoder(default))).size, rel=0.05)  # VITS
    with pytest.raises(ValueError, match="speed"):
        talk("Hi.", params={"speed": 9})


@pytest.mark.parametrize(
    ("chunk", "error"),
    [
        ("some text", TypeError),
        ({"text": "x"}, TypeError),
        ({"phoneme_ids": [1, "2"]}, TypeError),
        ({"phoneme_ids": [1, 10_000]}, ValueError),
    ],
)
def test_chunks_that_are_not_the_talkers_fail_clearly(chunk: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"talker chunk|phoneme ids"):
        list(piper.vocoder([chunk]))


def test_a_missing_model_is_a_config_error(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="need a voice model"):
        talk("Hi.", model=str(tmp_path / "none.onnx"))


def test_an_aborted_request_stops_the_talker_and_the_vocoder() -> None:
    text_in, ids_in = ChunkStream(), ChunkStream()
    text_in.extend(token_deltas("Say this much first. And"), closed=False)
    talker = piper.talker(text_in)
    ids_in.extend([next(talker)], closed=False)
    vocoder = piper.vocoder(ids_in, max_chunk_ms=5000)  # a clause in one piece
    assert next(vocoder).size > RATE // 2  # the first clause's audio, before the input ends
    text_in.abort()
    ids_in.abort()
    with pytest.raises(RequestAborted):
        next(talker)
    with pytest.raises(RequestAborted):
        next(vocoder)


@pytest.mark.usefixtures("needs_pocketsphinx")
def test_the_speech_is_understood_by_a_recogniser() -> None:
    from omni_runtime.engines.pocketsphinx import transcribe

    pcm = audio(unwrap(piper.vocoder(talk([*token_deltas(SENTENCES), None]))))
    heard = transcribe({"pcm": pcm, "sample_rate": RATE})
    assert wer(SENTENCES, heard) <= MAX_WER, heard
