"""Cutting a stream of text deltas into speakable clauses (pure: no engine)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_runtime.core.clauses import ClauseCutter, cut_text
from omni_runtime.engines.text_chunks import clauses_with_last, first_clause_chars_of
from omni_runtime.stage_api import ChunkStream, RequestAborted, RequestRefused

# Text rich in the characters the rules look at, so examples hit them often.
MARKED_TEXT = st.text(alphabet=st.sampled_from(list("ab Dr3.,;:!?…\n\"')")), max_size=300)
ANY_TEXT = st.one_of(MARKED_TEXT, st.text(max_size=300))


def feed_all(deltas: list[str], **limits: Any) -> list[str]:
    cutter = ClauseCutter(**limits)
    pieces = [p for d in deltas for p in cutter.feed(d)]
    return pieces + cutter.flush()


def split(text: str, cuts: list[int]) -> list[str]:
    at = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(at)]


def test_a_sentence_goes_out_when_the_next_delta_shows_it_ended() -> None:
    cutter = ClauseCutter()
    assert [cutter.feed(d) for d in [" Hel", "lo", ",", " world."]] == [[], [], [], []]
    assert cutter.feed(" The") == [" Hello, world."]
    assert cutter.feed(" end") == []
    assert cutter.flush() == [" The end"]


def test_a_period_at_the_end_of_a_delta_waits_for_what_follows() -> None:
    cutter = ClauseCutter()
    assert cutter.feed("Pi is 3.") == []
    assert cutter.feed("14 or so. ") == ["Pi is 3.14 or so."]


def test_abbreviations_initials_and_numbers_are_not_sentence_ends() -> None:
    text = "Dr. Smith met J. Doe at 3.14 on St. James Street. Eat fruit, e.g. apples. Ok"
    assert cut_text(text) == [
        "Dr. Smith met J. Doe at 3.14 on St. James Street.",
        " Eat fruit, e.g. apples.",
        " Ok",
    ]


def test_closing_quotes_and_repeated_marks_stay_with_their_sentence() -> None:
    assert cut_text('He said "Stop!" Why?! (Done.) Ok') == [
        'He said "Stop!"',
        " Why?!",
        " (Done.)",
        " Ok",
    ]


def test_a_clause_mark_cuts_only_once_the_clause_is_long_enough() -> None:
    text = "Well, as you can plainly see, it works; and then: more"
    assert cut_text(text, min_clause_chars=20) == [
        "Well, as you can plainly see,",
        " it works; and then: more",
    ]
    assert cut_text("one, two, three", min_clause_chars=3) == ["one,", " two,", " three"]


def test_a_newline_ends_a_piece_but_blank_lines_do_not_make_empty_ones() -> None:
    assert cut_text("\n\nFirst item\n\n- second item") == ["\n\nFirst item\n", "\n- second item"]


def test_run_on_text_is_cut_at_its_last_space_before_the_limit() -> None:
    text = "word " * 30
    pieces = cut_text(text, max_clause_chars=32)
    assert pieces[0] == "word word word word word word"
    assert all(len(p) <= 32 for p in pieces)
    assert cut_text("x" * 70, max_clause_chars=32) == ["x" * 32, "x" * 32, "x" * 6]


def test_the_first_piece_is_cut_short_and_each_next_at_most_twice_as_long() -> None:
    text = (
        "The sky looks blue because air scatters blue light more than red light, and so "
        "we see blue light coming from every part of the sky when we look up. It is so."
    )
    pieces = cut_text(text, first_clause_chars=24)
    assert pieces[0] == "The sky looks blue"
    assert pieces[1:] == [
        " because air scatters blue light more than red",  # at most 48
        " light, and so we see blue light coming from every part of the sky when we look up.",
        " It is so.",  # ^ at most 96: the sentence's end (" light," is too short a clause)
    ]
    assert cut_text("Yes. The sky is blue.", first_clause_chars=24) == ["Yes.", " The sky is blue."]


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        ClauseCutter(min_clause_chars=50, max_clause_chars=10)
    with pytest.raises(ValueError):
        ClauseCutter(max_clause_chars=100, first_clause_chars=101)


@given(ANY_TEXT, st.lists(st.integers(min_value=0), max_size=30), st.integers(1, 60))
def test_a_short_first_piece_does_not_depend_on_the_deltas_either(
    text: str, cuts: list[int], first: int
) -> None:
    pieces = feed_all(split(text, cuts), first_clause_chars=first)
    assert pieces == cut_text(text, first_clause_chars=first)
    assert "".join(pieces) == text
    assert all(len(p) <= min(first << k, 200) for k, p in enumerate(pieces))


@given(st.lists(ANY_TEXT, max_size=20))
def test_the_pieces_are_the_input_with_nothing_lost(deltas: list[str]) -> None:
    assert "".join(feed_all(deltas)) == "".join(deltas)


@given(ANY_TEXT, st.lists(st.integers(min_value=0), max_size=30))
def test_cuts_do_not_depend_on_where_the_deltas_split_the_text(text: str, cuts: list[int]) -> None:
    assert feed_all(split(text, cuts)) == cut_text(text)


@given(ANY_TEXT, st.integers(min_value=1, max_value=40), st.integers(min_value=0, max_value=60))
def test_no_piece_is_longer_than_the_limit(text: str, low: int, extra: int) -> None:
    limits = {"min_clause_chars": low, "max_clause_chars": low + extra}
    assert all(len(p) <= low + extra for p in cut_text(text, **limits))


@given(st.lists(st.one_of(st.none(), ANY_TEXT), max_size=12))
def test_clauses_keep_every_word_and_only_the_last_is_marked(
    deltas: list[str | None],
) -> None:
    out = list(clauses_with_last(deltas))
    assert [last for _, last in out] == [False] * (len(out) - 1) + [True]
    assert all(c.strip() == c for c, _ in out)
    said = "".join(d or "" for d in deltas)
    assert "".join("".join(c.split()) for c, _ in out) == "".join(said.split())  # all, in order


def test_the_last_clause_is_marked_as_soon_as_the_input_ends() -> None:
    assert list(clauses_with_last(["Hi there", ", how are you doing today?", " Fine."])) == [
        ("Hi there, how are you doing today?", False),
        ("Fine.", True),
    ]
    assert list(clauses_with_last("A prompt.")) == [("A prompt.", True)]


def test_input_that_ends_after_its_last_clause_closes_with_an_empty_one() -> None:
    assert list(clauses_with_last(["Done. ", "Really done. ", None])) == [
        ("Done.", False),
        ("Really done.", False),
        ("", True),
    ]
    assert list(clauses_with_last([])) == [("", True)]


def test_a_stream_gives_each_clause_before_it_ends_and_stops_on_abort() -> None:
    stream = ChunkStream()
    stream.extend(["First sentence here.", " Sec"], closed=False)
    clauses = clauses_with_last(stream)
    assert next(clauses) == ("First sentence here.", False)
    stream.abort()
    with pytest.raises(RequestAborted):
        next(clauses)


@pytest.mark.parametrize("bad", [{"text": "hi"}, b"bytes", 42, ["ok", 7]])
def test_input_that_is_not_text_is_refused(bad: object) -> None:
    with pytest.raises(TypeError, match="expected text"):
        list(clauses_with_last(bad))


def test_a_request_may_turn_the_short_first_piece_off_or_set_it() -> None:
    """A speech stream's pieces come cut already: `first_clause_chars: 0` keeps each whole
    (one clause, one pause), where the stage's short first piece would cut it again."""
    piece = " and the second piece is longer than the first"
    assert len(list(clauses_with_last(piece, first_clause_chars=14))) > 1
    first = first_clause_chars_of({"first_clause_chars": 0}, 14)
    assert first is None and [c for c, _ in clauses_with_last(piece, first_clause_chars=first)] == [
        piece.strip()
    ]
    assert first_clause_chars_of({"first_clause_chars": 30}, 14) == 30
    assert first_clause_chars_of({"voice": "joe"}, 14) == 14
    for bad in (True, -1, 1.5, "14", 201):
        with pytest.raises(RequestRefused, match="first_clause_chars"):
            first_clause_chars_of({"first_clause_chars": bad}, 14)
