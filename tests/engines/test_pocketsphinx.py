"""pocketsphinx as a speech-to-text stage, on real speech (piper's, as a stand-in speaker)."""

from __future__ import annotations

import io
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest

from omni_runtime.engines.pocketsphinx import (
    PAUSE_SEARCH_SECONDS,
    SEGMENT_SECONDS,
    read_wav,
    resample,
    segment_end,
    transcribe,
    transcribe_segments,
)
from omni_runtime.engines.wer import wer
from omni_runtime.stage_api import ChunkStream, RequestRefused
from omni_runtime.wav import write_wav
from tests.engines.speech import MAX_WER, SENTENCES, audio, unwrap

pytestmark = pytest.mark.timeout(120)
RATE = 22_050
Floats = npt.NDArray[np.float32]


@pytest.fixture(scope="module")
def speech(needs_piper: None, needs_pocketsphinx: None) -> Floats:
    """SENTENCES spoken (22,050 Hz float32), made once."""
    from omni_runtime.engines import piper

    return audio(unwrap(piper.vocoder(unwrap(piper.talker(SENTENCES)))))


def wav_bytes(pcm: Floats, tmp_path: Path) -> bytes:
    path = tmp_path / "speech.wav"
    write_wav(path, [pcm], RATE)
    return path.read_bytes()


def test_a_wav_file_is_transcribed(speech: Floats, tmp_path: Path) -> None:
    heard = transcribe(wav_bytes(speech, tmp_path))
    assert wer(SENTENCES, heard) <= MAX_WER, heard


@pytest.mark.parametrize("form", ["float32", "int16", "int16 bytes", "16 kHz"])
def test_pcm_comes_as_float_or_int16_at_any_rate(speech: Floats, form: str) -> None:
    pcm: Any = speech
    rate = RATE
    if form.startswith("int16"):
        pcm = np.round(speech * 32767).astype(np.int16)
        pcm = pcm.tobytes() if form.endswith("bytes") else pcm
    elif form == "16 kHz":
        pcm, rate = resample(speech, RATE, 16_000), 16_000
    heard = transcribe({"pcm": pcm, "sample_rate": rate})
    assert wer(SENTENCES, heard) <= MAX_WER, heard


def test_pieces_are_decoded_as_they_arrive(speech: Floats) -> None:
    stream = ChunkStream()
    step = RATE // 2
    for i in range(0, speech.size, step):
        stream.extend([{"pcm": speech[i : i + step], "sample_rate": RATE}], closed=False)
    stream.extend([], closed=True)
    heard = transcribe(stream)
    assert wer(SENTENCES, heard) <= MAX_WER, heard


def test_requests_at_once_share_at_most_max_decoders(speech: Floats) -> None:
    from pocketsphinx import get_model_path

    from omni_runtime.engines import pocketsphinx

    # the bundled dictionary named explicitly: a model key (and a pool) of this test's own
    dictionary = get_model_path("en-us/cmudict-en-us.dict")
    half = speech.size // 2
    inputs = [speech, speech[:half], speech]

    def hear(pcm: Floats) -> str:
        data = {"pcm": pcm, "sample_rate": RATE}
        return transcribe(data, dictionary=dictionary, max_decoders=1)

    with ThreadPoolExecutor(3) as pool:
        whole, first, again = pool.map(hear, inputs)
    assert wer(SENTENCES, whole) <= MAX_WER and wer(SENTENCES, again) <= MAX_WER
    assert len(first.split()) < len(whole.split())
    assert pocketsphinx._decoders[(None, None, dictionary)].made == 1


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_what_a_decoder_heard_before_does_not_change_what_it_hears_next(
    speech: Floats, streamed: bool
) -> None:
    """One decoder serves every request: quiet speech is heard alike before and after it
    has heard loud speech (a running cepstral mean kept across requests would not)."""
    from pocketsphinx import get_model_path

    lm = get_model_path("en-us/en-us.lm.bin")  # named: a model key (and a decoder) of its own

    def hear(pcm: Floats) -> str:
        if not streamed:
            return transcribe({"pcm": pcm, "sample_rate": RATE}, lm=lm, max_decoders=1)
        stream = ChunkStream()
        stream.extend([{"pcm": pcm[i : i + RATE // 2], "sample_rate": RATE}
                       for i in range(0, pcm.size, RATE // 2)], closed=True)  # fmt: skip
        return transcribe(stream, lm=lm, max_decoders=1)

    quiet = speech * np.float32(0.03)
    first = hear(quiet)
    for _ in range(3):
        hear(speech)
    assert hear(quiet) == first


def test_long_audio_is_heard_in_segments_cut_at_pauses(speech: Floats) -> None:
    twice = np.concatenate([speech, speech])  # past SEGMENT_SECONDS, in one piece
    assert twice.size / RATE > 2 * SEGMENT_SECONDS
    heard = transcribe({"pcm": twice, "sample_rate": RATE})
    assert wer(f"{SENTENCES} {SENTENCES}", heard) <= MAX_WER, heard
    pieces = cast(list[str], list(transcribe_segments({"pcm": twice, "sample_rate": RATE})))
    assert len(pieces) >= 2 and "".join(pieces) == heard, pieces  # a stream's deltas
    assert all(p.startswith(" ") for p in pieces[1:]) and not pieces[0].startswith(" ")
    # asked for timestamps (subtitles): the same pieces, each with when its words were said,
    # in the recording's time across segments
    asked = {"timestamps": ["segment", "word"]}
    timed = cast(
        list[dict[str, Any]],
        list(transcribe_segments({"pcm": twice, "sample_rate": RATE}, params=asked)),
    )
    assert [t["text"] for t in timed] == pieces
    words = [w for t in timed for w in t["words"]]
    assert " ".join(w["word"] for w in words) == heard
    starts = [w["start"] for w in words]
    assert starts == sorted(starts) and all(w["end"] > w["start"] for w in words)
    assert starts[0] >= 0 and words[-1]["end"] <= twice.size / RATE
    assert all(t["start"] == t["words"][0]["start"] and t["end"] == t["words"][-1]["end"]
               for t in timed)  # fmt: skip
    second = timed[-1]["start"]  # the second saying starts where the first ended
    assert second > SEGMENT_SECONDS / 2, timed


def test_a_segment_ends_in_the_quietest_stretch_of_its_last_seconds() -> None:
    rng = np.random.default_rng(0)
    loud = rng.integers(-8000, 8000, int(2 * SEGMENT_SECONDS * 16_000)).astype("<i2")
    gap_at = int((SEGMENT_SECONDS - 1.5) * 16_000)
    loud[gap_at : gap_at + 3_200] //= 100  # a 200 ms pause
    early = int((SEGMENT_SECONDS - PAUSE_SEARCH_SECONDS - 1) * 16_000)
    loud[early : early + 3_200] = 0  # quieter, but before the stretch searched
    cut = segment_end(bytearray(loud.tobytes())) // 2
    assert gap_at <= cut <= gap_at + 3_200


def test_a_quiet_room_says_nothing(needs_pocketsphinx: None) -> None:
    hiss = np.random.default_rng(0).standard_normal(16_000).astype(np.float32) * 1e-3
    assert transcribe({"pcm": hiss, "sample_rate": 16_000}) == ""


def test_a_turn_with_nothing_to_hear_is_no_words(needs_pocketsphinx: None) -> None:
    """A conversation's turn without speech (the answer to a tool's result, `spoken_turn`)."""
    turn = {"wav": None, "messages": [{"role": "user", "content": "Result of clock: noon"}]}
    assert transcribe(turn) == ""
    assert list(transcribe_segments(turn)) == []
    with pytest.raises(TypeError, match="expected WAV bytes"):  # no turn: still refused
        transcribe({"wav": None})


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (b"not a wav file", ValueError, "not a PCM WAV"),
        (b"", ValueError, "not a PCM WAV file: the file is empty"),
        (b"RIFF$\0\0\0WAVEfmt \x10\0\0\0\x01\0", ValueError, "the file ends within its header"),
        ("some text", TypeError, "expected WAV bytes"),
        ({"pcm": np.zeros(10, np.float32), "sample_rate": 100}, ValueError, "sample_rate"),
        ({"pcm": np.zeros(10, np.float32), "sample_rate": 16e3}, ValueError, "sample_rate"),
        ({"pcm": np.full(10, np.nan, np.float32), "sample_rate": 16_000}, ValueError, "NaN"),
        ({"pcm": np.zeros(10, np.int32), "sample_rate": 16_000}, TypeError, "float or int16"),
        ({"pcm": b"\x00\x01\x02", "sample_rate": 16_000}, ValueError, "even number"),
        ({"pcm": [0.0, 0.1], "sample_rate": 16_000}, TypeError, "numpy array"),
    ],
)
def test_bad_input_fails_with_what_was_wrong(
    needs_pocketsphinx: None, data: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        transcribe(data)


def test_audio_over_max_seconds_is_refused(needs_pocketsphinx: None) -> None:
    two_s = {"pcm": np.zeros(32_000, dtype=np.float32), "sample_rate": 16_000}
    with pytest.raises(ValueError, match="max_seconds=1"):
        transcribe(two_s, max_seconds=1)


def test_a_language_the_model_does_not_hear_is_refused(
    needs_pocketsphinx: None, speech: Floats
) -> None:
    """OpenAI's `language`: the model's own (as a tag too) is heard; another is refused,
    rather than heard as wrong English words."""
    pcm = {"pcm": speech[: 3 * RATE], "sample_rate": RATE}
    heard = transcribe(pcm)
    assert heard
    for same in ("en", "en-US", "EN_gb"):
        assert transcribe(pcm, params={"language": same}) == heard
    for other in ("fr", "", 7):
        with pytest.raises(RequestRefused, match="hears 'en' only") as refused:
            list(transcribe_segments(pcm, params={"language": other}))
        assert refused.value.code == "unsupported_language"
    assert transcribe(pcm, language="fr", params={"language": "fr-FR"})  # another model's


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_pcm_wav_of_any_width_and_channels_reads_as_mono(width: int) -> None:
    t = np.arange(800) / 8000
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([tone, tone], axis=1).reshape(-1)
    scale = 2 ** (8 * width - 1) - 1
    ints = np.round(stereo * scale).astype(np.int64)
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    else:
        raw = b"".join(int(v).to_bytes(width, "little", signed=True) for v in ints)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(width)
        w.setframerate(8000)
        w.writeframes(raw)
    samples, rate = read_wav(buf.getvalue())
    assert rate == 8000 and samples.dtype == np.float32
    assert np.allclose(samples, tone, atol=2.0 / 2 ** (8 * width - 1) + 1e-6)


def test_resampling_keeps_the_pitch_and_the_duration() -> None:
    t = np.arange(RATE) / RATE
    tone = np.sin(2 * np.pi * 1000 * t).astype(np.float32)
    out = resample(tone, RATE, 16_000)
    assert out.size == 16_000
    assert int(np.argmax(np.abs(np.fft.rfft(out)))) == 1000  # 1 Hz bins over 1 s
