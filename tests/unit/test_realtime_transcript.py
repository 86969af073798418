"""The user's transcript on `/v1/realtime` (`realtime_response`): the orchestrator routes each
stage's outputs apart, so a later stage's output may reach the front door before the
speech-to-text stage's words it answers. The transcript waits for those words, once,
instead of being said empty; a response cancelled says the words heard, if any.

The outputs are given in that order by a stand-in for the client's stream: with real
processes the order is a race (seen in a CI run, not reproducible on demand)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

from omni_runtime.core.types import OrchOutput
from omni_runtime.http.events import FailureEvent
from omni_runtime.http.gateway import Run
from omni_runtime.http.realtime_response import Item, Response, Status
from omni_runtime.pipeline import PipelineConfig

TRANSCRIBED = "conversation.item.input_audio_transcription.completed"


class Stream:
    """The request's outputs, each handed over when the test releases it."""

    def __init__(self, outputs: list[OrchOutput]) -> None:
        self.outputs = outputs
        self.released = asyncio.Semaphore(0)

    async def stream(self, _rid: str, _timeout_s: float) -> AsyncIterator[OrchOutput]:
        for out in self.outputs:
            await self.released.acquire()
            yield out


def response(stream: Stream, emitted: list[dict[str, Any]]) -> tuple[Response, Any]:
    pipeline = PipelineConfig.model_validate({
        "name": "hears", "final_stage_ids": [0, 1],
        "stages": [{"id": 0, "name": "stt", "entry": "m:f"}, {"id": 1, "name": "llm", "entry": "m:f"}],
        "outputs": {"input": "audio", "text_stage": 1, "sample_rate": 24_000, "text_separator": " "},
    })  # fmt: skip
    served: Any = SimpleNamespace(outputs=pipeline.outputs, pipeline=pipeline)
    gateway: Any = SimpleNamespace(timer=SimpleNamespace(output=lambda *_a: None))
    done: list[Status] = []
    r = Response(
        gateway=gateway,
        served=served,
        emit=emitted.append,
        prompt={"messages": []},
        params={},
        modalities=["text"],
        heard=Item("item_you", "user", kind="audio"),
        speech_end=None,
        playback=cast(Any, None),
        on_done=lambda _r, status: done.append(status),
        timeout_s=10,
    )
    run = Run(gateway, served, cast(Any, stream), "r", audio=False)  # over a fake stream
    return r, run


def streaming(
    outputs: list[OrchOutput],
) -> tuple[Stream, list[dict[str, Any]], Response, asyncio.Task[FailureEvent | None]]:
    """A response of a spoken turn (its audio kept) whose outputs come as released."""
    stream, emitted = Stream(outputs), list[dict[str, Any]]()
    r, run = response(stream, emitted)
    assert r.heard is not None
    r.heard.audio = b"\0\0"
    return stream, emitted, r, asyncio.create_task(r._stream(run))


def transcripts(emitted: list[dict[str, Any]]) -> list[str]:
    return [e["transcript"] for e in emitted if e["type"] == TRANSCRIBED]


async def release_until(stream: Stream, cond: Any) -> None:
    for _ in range(len(stream.outputs)):
        if cond():
            return
        stream.released.release()
        for _ in range(5):
            await asyncio.sleep(0)


async def test_the_answer_first_then_the_words_the_transcript_waits_for_them() -> None:
    stream, emitted, r, task = streaming([
        OrchOutput("r", 1, "You", False),  # the answer's first piece, routed first
        OrchOutput("r", 0, "what is the weather", False),
        OrchOutput("r", 1, "said", False),
        OrchOutput("r", 1, "it", True),
    ])  # fmt: skip
    await release_until(stream, lambda: False)
    assert await asyncio.wait_for(task, 5) is None
    assert transcripts(emitted) == ["what is the weather"]
    assert r.heard is None  # said once


async def test_the_words_first_are_said_as_the_answer_starts() -> None:
    stream, emitted, _r, task = streaming(
        [OrchOutput("r", 0, "hello there", False), OrchOutput("r", 1, "hi", True)]
    )
    await release_until(stream, lambda: any(e["type"] == TRANSCRIBED for e in emitted))
    kinds = [e["type"] for e in emitted]
    assert kinds[-2:] == [TRANSCRIBED, "response.output_text.delta"]
    stream.released.release()
    await asyncio.wait_for(task, 5)
    assert transcripts(emitted) == ["hello there"]


async def test_a_response_cancelled_after_the_words_says_them() -> None:
    stream, emitted, r, task = streaming(
        [OrchOutput("r", 1, "You", False), OrchOutput("r", 0, "hello", False)]
    )
    await release_until(stream, lambda: any(e["type"] == TRANSCRIBED for e in emitted))
    assert transcripts(emitted) == ["hello"]
    r.cancel("turn_detected")
    assert transcripts(emitted) == ["hello"]  # once
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_response_cancelled_before_any_words_leaves_the_turn_to_be_heard_again() -> None:
    """Nothing heard: no empty transcript, and the turn's audio stays, so that a next
    `response.create` hears it (as `_prompt` requires)."""
    stream, emitted, r, task = streaming(
        [OrchOutput("r", 1, "You", False), OrchOutput("r", 0, "late", False)]
    )
    heard = r.heard
    assert heard is not None
    await release_until(
        stream, lambda: any(e["type"] == "response.output_text.delta" for e in emitted)
    )
    r.cancel("turn_detected")
    assert transcripts(emitted) == []
    assert heard.audio == b"\0\0"
    assert emitted[-1]["type"] == "response.done"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
