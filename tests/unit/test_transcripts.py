"""A transcription's timed forms (`http/transcripts.py`): timed text checked at the boundary,
cues cut for a reader, clocks as SubRip and WebVTT write them."""

from __future__ import annotations

import math

from omni_runtime.http.transcripts import (
    MAX_CUE_CHARS,
    TimedText,
    TimedWord,
    cues,
    segments_of,
    text_of,
    verbose_json,
)


def test_a_text_stages_output_is_its_text_and_its_timing_if_that_checks() -> None:
    assert text_of("hi") == ("hi", None)
    text, timing = text_of({"text": " hi", "start": 1.0, "end": 1.5})
    assert text == " hi" and timing == TimedText(text=" hi", start=1.0, end=1.5)
    for bad in (
        {"text": "hi", "start": 2.0, "end": 1.0},  # ends before it starts
        {"text": "hi", "start": math.nan, "end": 1.0},
        {"text": "hi", "start": -1.0, "end": 1.0},
        {"text": "hi", "start": 0, "end": 1, "words": [{"word": "hi", "start": 1, "end": 0}]},
        {"text": "hi"},
    ):
        assert text_of(bad) == ("hi", None), bad  # the text still counts
    assert text_of({"other": 1}) == ("{'other': 1}", None)


def test_untimed_pieces_make_one_segment_over_the_recording() -> None:
    timed = TimedText(text="a", start=0.5, end=1.0)
    assert segments_of([("a", timed), (" b", None)], 3.0) == [
        TimedText(text="a b", start=0.0, end=3.0)
    ]
    assert segments_of([(" ", None)], 3.0) == []
    assert segments_of([("x", timed)], 3.0) == [timed.model_copy(update={"text": "x"})]


def test_verbose_json_says_only_what_it_knows() -> None:
    word = TimedWord(word="hi", start=0.1, end=0.4)
    seg = TimedText(text=" hi", start=0.1, end=0.4, words=[word])
    body = verbose_json([seg], 1.23456, ["segment"], None)
    assert body == {"task": "transcribe", "duration": 1.235, "text": "hi",
                    "segments": [{"id": 0, "start": 0.1, "end": 0.4, "text": " hi"}]}  # fmt: skip
    body = verbose_json([seg], 1.0, ["word"], "en")
    assert body["language"] == "en" and "segments" not in body
    assert body["words"] == [{"word": "hi", "start": 0.1, "end": 0.4}]


def test_cues_break_at_pauses_and_at_two_lines_of_text() -> None:
    words = [TimedWord(word=f"word{i:02d}", start=i * 0.5, end=i * 0.5 + 0.4) for i in range(20)]
    words[5] = TimedWord(word="word05", start=3.0, end=3.4)  # 0.6 s after word04 ends
    seg = TimedText(text="…", start=0.0, end=10.0, words=words)
    srt = cues([seg], "srt").split("\n\n")
    assert srt[0] == "1\n00:00:00,000 --> 00:00:02,400\nword00 word01 word02 word03 word04"
    assert srt[1].startswith("2\n00:00:03,000 --> ")
    texts = [block.split("\n")[2] for block in srt if block]
    assert " ".join(texts) == " ".join(w.word for w in words)
    assert all(len(t) <= MAX_CUE_CHARS for t in texts)


def test_clocks_as_each_format_writes_them() -> None:
    seg = TimedText(text=" late ", start=3661.5, end=3662.0005)
    assert cues([seg], "srt") == "1\n01:01:01,500 --> 01:01:02,001\nlate\n"
    assert cues([seg], "vtt") == "WEBVTT\n\n01:01:01.500 --> 01:01:02.001\nlate\n"
    assert cues([], "vtt") == "WEBVTT\n\n"
