"""A spoken turn joins its conversation the same way in both modes: sequential mode's
forward, and streaming mode's thinker reading the prompt its ChunkStream carries."""

from __future__ import annotations

from typing import Any

import pytest

from omni_runtime.engines.spoken_turn import forward, heard_turn, unspoken, upstream_text
from omni_runtime.stage_api import ChunkStream
from tests.unit.test_worker_core import ListEngine, inp, make

pytestmark = pytest.mark.timeout(30)

HISTORY = [{"role": "user", "content": "Remember the word banana."},
           {"role": "assistant", "content": "Banana it is."}]  # fmt: skip
TURN = {"wav": b"RIFF...", "messages": HISTORY}


def test_the_transcript_follows_the_messages_sent_with_the_speech() -> None:
    assert heard_turn(TURN, "what word") == {
        "messages": [*HISTORY, {"role": "user", "content": "what word"}]
    }
    assert heard_turn({"wav": b"RIFF..."}, "what word") == "what word"
    assert heard_turn(b"RIFF...", "what word") == "what word"  # a bare WAV
    assert heard_turn({"wav": b"", "messages": []}, "hi") == "hi"


def test_the_messages_after_the_spoken_turn_follow_its_transcript() -> None:
    """A tool's call and result after the question: the question is heard in its place."""
    after = [{"role": "assistant", "content": "Let me call time with {}."},
             {"role": "user", "content": "Result of time: noon"}]  # fmt: skip
    heard = heard_turn({**TURN, "after": after}, "what time is it")
    assert heard == {"messages": [*HISTORY, {"role": "user", "content": "what time is it"}, *after]}
    assert heard_turn({"wav": b"RIFF...", "after": after}, "hi") == {
        "messages": [{"role": "user", "content": "hi"}, *after]
    }


def test_an_unspoken_turn_is_its_messages_alone() -> None:
    """`wav: None`: nothing to hear (the answer to a tool's result); no empty user turn."""
    turn = {"wav": None, "messages": HISTORY}
    assert unspoken(turn) and not unspoken(TURN) and not unspoken(b"RIFF...")
    assert heard_turn(turn, "") == {"messages": HISTORY}
    assert forward(1, turn, [""]) == {"messages": HISTORY}


def test_sequential_forward_builds_the_thinkers_input_and_passes_later_stages_by() -> None:
    chunks = ["what ", "word", ""]
    assert forward(1, TURN, chunks) == heard_turn(TURN, "what word")
    assert forward(1, b"RIFF...", chunks) == "what word"
    assert forward(2, TURN, ["Banana."]) == ["Banana."]


class Keeping(ListEngine):
    """Keeps what each request was given."""

    def __init__(self) -> None:
        super().__init__()
        self.given: dict[str, Any] = {}

    def add_request(self, request_id: str, data: Any) -> None:
        self.given[request_id] = data


def test_a_streaming_stage_gets_the_prompt_with_its_upstreams_chunks() -> None:
    core, engine = make(Keeping(), streaming=True)
    core.on_input(inp("a", TURN, streaming=True), now=0)
    stream = engine.given["a"]  # type: ignore[attr-defined]
    assert isinstance(stream, ChunkStream) and stream.prompt == TURN
    stream.extend(["what ", "word"], closed=True)
    assert heard_turn(stream.prompt, upstream_text(stream)) == forward(1, TURN, ["what word"])
