"""Word error rate, the measure every intelligibility check here uses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_runtime.engines.wer import wer, word_errors, words

WORD_LISTS = st.lists(st.sampled_from(["a", "b", "c", "dog", "don't"]), max_size=12)


def test_case_and_punctuation_do_not_count() -> None:
    assert words("Hello, World! Don't stop.") == ["hello", "world", "don't", "stop"]
    assert wer("Hello, world.", "hello world") == 0.0


@pytest.mark.parametrize(
    ("hypothesis", "errors"),
    [
        ("the quick brown fox", 0),
        ("the quick brown box", 1),  # a substitution
        ("the brown fox", 1),  # a deletion
        ("the very quick brown fox", 1),  # an insertion
        ("", 4),
        ("fox brown quick the", 4),
    ],
)
def test_errors_are_the_edit_distance_over_words(hypothesis: str, errors: int) -> None:
    assert wer("The quick brown fox.", hypothesis) == errors / 4


def test_an_empty_reference_counts_each_added_word() -> None:
    assert wer("", "") == 0.0
    assert wer("...", "one two") == 2.0


@given(WORD_LISTS, WORD_LISTS)
def test_the_distance_is_symmetric_and_bounded_by_the_longer_list(
    a: list[str], b: list[str]
) -> None:
    d = word_errors(a, b)
    assert d == word_errors(b, a)
    assert abs(len(a) - len(b)) <= d <= max(len(a), len(b))
    assert (d == 0) == (a == b)
