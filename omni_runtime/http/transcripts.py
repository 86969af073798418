"""A transcription's answers: OpenAI's `json` and its streamed events, and the timed
forms, `verbose_json` (segments, and words if asked), SubRip (`srt`) and WebVTT (`vtt`).

A text stage that knows when its words were said gives each piece as `{"text", "start",
"end", "words"?}` when the request's `params` ask for `timestamps`
(`engines/pocketsphinx.transcribe_segments` does); `TimedText` checks such a piece at the
boundary. A stage that gives plain text still gets a transcription: one segment, from the
recording's start to its end, and no words (it would be a guess to split it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

Granularity = Literal["segment", "word"]
TimedFormat = Literal["verbose_json", "srt", "vtt"]

MAX_WORDS = 10_000
"""The most words one piece may time (8 s of speech hold a few dozen)."""

MAX_CUE_CHARS = 84
"""A subtitle cue's most characters: two lines of 42, the common broadcast limit."""
CUE_PAUSE_S = 0.5
"""A pause this long between two words ends a cue."""


class Transcription(BaseModel):
    text: str


class TranscriptTextDelta(BaseModel):
    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TranscriptUsage(BaseModel):
    type: Literal["tokens"] = "tokens"
    input_tokens: int
    output_tokens: int
    total_tokens: int


class TranscriptTextDone(BaseModel):
    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str
    usage: TranscriptUsage | None = None
    """Only when the pipeline's engine counted its tokens."""


Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class TimedWord(BaseModel):
    word: Annotated[str, Field(max_length=256)]
    start: Seconds
    end: Seconds


class TimedText(BaseModel):
    text: str
    start: Seconds
    end: Seconds
    words: Annotated[list[TimedWord], Field(max_length=MAX_WORDS)] | None = None

    @model_validator(mode="after")
    def _ordered(self) -> TimedText:
        if self.end < self.start or any(w.end < w.start for w in self.words or []):
            raise ValueError("a piece or word ends before it starts")
        return self


def text_of(data: Any) -> tuple[str, TimedText | None]:
    """A text stage's output as text, and its timing if it is timed text (a piece whose
    timing does not check is its text alone)."""
    if isinstance(data, str):
        return data, None
    if isinstance(data, dict) and isinstance(data.get("text"), str):
        try:
            timed = TimedText.model_validate(data)
        except ValidationError:
            return data["text"], None
        return timed.text, timed
    return str(data), None


def segments_of(pieces: Sequence[tuple[str, TimedText | None]], duration: float) -> list[TimedText]:
    """The transcription's segments: the pieces as timed, or the whole text over the whole
    recording when any piece came untimed."""
    if pieces and all(timing is not None for _text, timing in pieces):
        return [t.model_copy(update={"text": text}) for text, t in pieces if t is not None]
    text = "".join(text for text, _timing in pieces)
    return [TimedText(text=text, start=0.0, end=duration)] if text.strip() else []


def verbose_json(
    segments: list[TimedText],
    duration: float,
    granularities: Sequence[Granularity],
    language: str | None,
) -> dict[str, Any]:
    """OpenAI's `verbose_json`: the fields this runtime knows; none it would have to make up
    (a segment's token ids, log probability, compression ratio, no-speech probability)."""
    body: dict[str, Any] = {
        "task": "transcribe",
        "duration": round(duration, 3),
        "text": "".join(s.text for s in segments).strip(),
    }
    if language is not None:  # the one asked for (a stage refuses one it does not hear)
        body["language"] = language
    if "segment" in granularities:
        body["segments"] = [
            {"id": i, "start": s.start, "end": s.end, "text": s.text}
            for i, s in enumerate(segments)
        ]
    if "word" in granularities:
        body["words"] = [w.model_dump() for s in segments for w in s.words or []]
    return body


def cues(segments: list[TimedText], fmt: Literal["srt", "vtt"]) -> str:
    """The segments as SubRip or WebVTT cues, each cut into lines a viewer can read
    (`MAX_CUE_CHARS`, and at each pause of `CUE_PAUSE_S`) where its words are timed."""
    comma = fmt == "srt"
    blocks = [
        f"{_clock(start, comma)} --> {_clock(end, comma)}\n{text}\n"
        for segment in segments
        for text, start, end in _cut(segment)
    ]
    if fmt == "srt":
        return "\n".join(f"{i}\n{block}" for i, block in enumerate(blocks, 1))
    return "WEBVTT\n\n" + "\n".join(blocks)


def _cut(segment: TimedText) -> list[tuple[str, float, float]]:
    if not segment.words:
        text = segment.text.strip()
        return [(text, segment.start, segment.end)] if text else []
    cut: list[tuple[str, float, float]] = []
    line: list[TimedWord] = []
    for word in segment.words:
        if line and (
            word.start - line[-1].end >= CUE_PAUSE_S
            or len(" ".join(w.word for w in [*line, word])) > MAX_CUE_CHARS
        ):
            cut.append((" ".join(w.word for w in line), line[0].start, line[-1].end))
            line = []
        line.append(word)
    cut.append((" ".join(w.word for w in line), line[0].start, line[-1].end))
    return cut


def _clock(seconds: float, comma: bool) -> str:
    ms = math.floor(seconds * 1000 + 0.5)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{',' if comma else '.'}{ms:03d}"
