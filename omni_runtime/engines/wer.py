"""Word error rate: how far a recogniser's transcript is from the text that was spoken.

Both texts are normalised first (lowercase, punctuation dropped, apostrophes inside
words kept), then compared word by word: (substitutions + deletions + insertions) /
words in the reference, by edit distance.
"""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")


def words(text: str) -> list[str]:
    """The text's words, lowercased, without punctuation."""
    return _WORD.findall(text.lower())


def word_errors(reference: list[str], hypothesis: list[str]) -> int:
    """The fewest word substitutions, deletions and insertions turning one into the other."""
    row = list(range(len(hypothesis) + 1))
    for i, ref in enumerate(reference, 1):
        prev, row = row, [i] + [0] * len(hypothesis)
        for j, hyp in enumerate(hypothesis, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ref != hyp))
    return row[-1]


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate of `hypothesis` against `reference` (0.0 is perfect; it can pass 1.0
    when the hypothesis adds words). An empty reference counts each added word as 1."""
    ref, hyp = words(reference), words(hypothesis)
    return word_errors(ref, hyp) / max(len(ref), 1)
