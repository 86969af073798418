"""Cut a stream of text deltas (a model's token pieces) into speakable clauses, as each ends.

A TTS engine speaks whole clauses well and half-words badly, and the first audio can
start only once the first clause is complete; so the talker cuts where a speaker would
pause, as soon as it can tell:

* after a sentence end (`.`, `!`, `?`, `…`, with any closing quotes or brackets) that is
  followed by whitespace — so `3.14`, `e.g.` and `Dr. Smith` are not cuts, and a `.` at
  the end of a delta waits for the next delta's first character;
* after a newline;
* after a clause mark (`,`, `;`, `:`) followed by whitespace, once the clause has
  `min_clause_chars` characters (short clauses sound choppy);
* at the last space before `max_clause_chars` when a clause runs on without any mark
  (bounding the wait for the first audio and the TTS input);
* with `first_clause_chars` set, the first piece already at the last space before
  that many characters, the second before twice as many, and so on up to
  `max_clause_chars`: the first audio waits for the LLM to write the first piece and
  for the TTS to speak all of it, so a short first piece is what makes streaming start
  early; and each piece at most twice as long as the one before is spoken while that
  one plays, so the audio has no gap once it started (a whole long clause would take
  longer to make than a short first piece takes to play).

Pieces keep every character (whitespace starts the next piece), so their concatenation is
the input; and a cut depends only on the text, never on where the deltas split it.
"""

from __future__ import annotations

from typing import Any

SENTENCE_ENDS = frozenset(".!?…")
CLAUSE_MARKS = frozenset(",;:")
CLOSERS = frozenset("\"')]}\u201d\u2019\u00bb")  # and the closing curly quotes, guillemet
OPENERS = "\"'([{\u201c\u2018\u00ab"
ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "e.g", "i.e", "cf", "approx", "fig"}
)
DEFAULT_MIN_CLAUSE_CHARS = 20
DEFAULT_MAX_CLAUSE_CHARS = 200
DEFAULT_FIRST_CLAUSE_CHARS = 14


class ClauseCutter:
    """Feed text deltas, get back the pieces that are complete; `flush` gives the rest."""

    def __init__(
        self,
        min_clause_chars: int = DEFAULT_MIN_CLAUSE_CHARS,
        max_clause_chars: int = DEFAULT_MAX_CLAUSE_CHARS,
        first_clause_chars: int | None = None,
    ) -> None:
        if not 1 <= min_clause_chars <= max_clause_chars:
            raise ValueError("need 1 <= min_clause_chars <= max_clause_chars")
        if first_clause_chars is not None and not 1 <= first_clause_chars <= max_clause_chars:
            raise ValueError("need 1 <= first_clause_chars <= max_clause_chars")
        self.min_clause_chars = min_clause_chars
        self.max_clause_chars = max_clause_chars
        self.first_clause_chars = first_clause_chars
        self._cut = 0
        """Pieces cut so far (the growing limit's step)."""
        self._buf = ""
        self._scan = 0
        """Where scanning resumes: every index before it was decided not to be a cut."""

    def feed(self, delta: str) -> list[str]:
        self._buf += delta
        pieces: list[str] = []
        while (cut := self._next_cut()) is not None:
            pieces.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            self._scan = 0
            self._cut += 1
        return pieces

    def flush(self) -> list[str]:
        """The text after the last cut (the stream ended), if any."""
        rest, self._buf, self._scan = self._buf, "", 0
        self._cut += bool(rest)
        return [rest] if rest else []

    def _next_cut(self) -> int | None:
        """The end of the first complete piece in the buffer, or None (need more text)."""
        buf, limit = self._buf, self.max_clause_chars
        if self.first_clause_chars is not None:
            limit = min(limit, self.first_clause_chars << min(self._cut, 16))
        i = self._scan
        while i < len(buf):
            if i >= limit:  # a run-on clause: cut at its last space (or hard, if none)
                space = max(buf.rfind(" ", 1, limit), buf.rfind("\n", 1, limit))
                return space if space > 0 and buf[:space].strip() else limit
            c = buf[i]
            if c == "\n" and _has_words(buf[:i]):
                return i + 1
            if c in SENTENCE_ENDS or c in CLAUSE_MARKS:
                j = i + 1
                while j < len(buf) and j < limit and (buf[j] in CLOSERS or buf[j] in SENTENCE_ENDS):
                    j += 1
                if j >= limit:
                    return limit
                if j == len(buf):
                    self._scan = i  # what follows decides: wait for the next delta
                    return None
                if buf[j].isspace() and self._ends_clause(buf[:j], c):
                    return j
                i = j
                continue
            i += 1
        self._scan = i
        return None

    def _ends_clause(self, piece: str, mark: str) -> bool:
        if not _has_words(piece):
            return False
        if mark in CLAUSE_MARKS:
            return len(piece.strip()) >= self.min_clause_chars
        if mark == ".":
            word = piece.rstrip("".join(CLOSERS) + ".").rsplit(None, 1)[-1].lstrip(OPENERS)
            if word.lower() in ABBREVIATIONS or (len(word) == 1 and word.isupper()):
                return False
        return True


def _has_words(text: str) -> bool:
    return any(ch.isalnum() for ch in text)


def cut_text(text: str, **limits: Any) -> list[str]:
    """A whole text's pieces (the same as feeding it in any number of deltas)."""
    cutter = ClauseCutter(**limits)
    return [*cutter.feed(text), *cutter.flush()]
