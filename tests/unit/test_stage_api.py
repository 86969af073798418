"""The stage interface: how functions, generators and step engines are driven."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from omni_runtime.stage_api import (
    ChunkStream,
    EngineOutput,
    Final,
    RequestAborted,
    RequestRefused,
    TokenUsage,
    marks_final,
    with_last,
)
from omni_runtime.worker.engines import GeneratorEngine
from tests.waiting import wait_for, wait_until

pytestmark = pytest.mark.timeout(30)


def drain(engine: GeneratorEngine, rid: str, deadline_s: float = 10.0) -> list[EngineOutput]:
    outs: list[EngineOutput] = []

    def done() -> bool:
        outs.extend(o for o in engine.step() if o.request_id == rid)
        return bool(outs) and (outs[-1].finished or outs[-1].error is not None)

    wait_until(done, deadline_s)
    return outs


def engine_for(fn: Callable[..., Any], **options: Any) -> GeneratorEngine:
    return GeneratorEngine(fn, options, max_concurrency=4, wake=lambda: None)


def triples(outs: list[EngineOutput]) -> list[tuple[Any, bool, str | None]]:
    return [(o.data, o.finished, o.error) for o in outs]


def test_a_function_returning_a_value_is_one_finished_chunk() -> None:
    engine = engine_for(lambda data, suffix: data + suffix, suffix="!")
    engine.add_request("r", "hi")
    assert triples(drain(engine, "r")) == [("hi!", True, None)]
    engine.close()


def test_a_plain_generator_marks_its_last_chunk_when_it_ends() -> None:
    def gen(data: list[int]) -> Iterator[int]:
        yield from data

    engine = engine_for(gen)
    engine.add_request("r", [1, 2, 3])
    assert triples(drain(engine, "r")) == [(1, False, None), (2, False, None), (3, True, None)]
    engine.close()


def gated(
    release: threading.Event, reached: threading.Event | None = None
) -> Callable[[Any], Iterator[Any]]:
    def gen(_data: Any) -> Iterator[Any]:
        yield "first"
        if reached is not None:
            reached.set()  # "first" was yielded and taken by the engine
        assert release.wait(10)
        yield Final("last")

    return gen


def wait_for_outputs(engine: GeneratorEngine, n: int) -> list[EngineOutput]:
    outs: list[EngineOutput] = []

    def enough() -> bool:
        outs.extend(engine.step())
        return len(outs) >= n

    wait_until(enough)
    return outs


def test_a_plain_generator_holds_one_chunk_back() -> None:
    release, reached = threading.Event(), threading.Event()
    engine = engine_for(gated(release, reached))
    engine.add_request("r", None)
    assert reached.wait(10)  # the generator yielded "first" and is blocked on the gate
    assert engine.step() == []  # held back: it might be the last one
    release.set()
    assert triples(wait_for_outputs(engine, 2)) == [("first", False, None), ("last", True, None)]
    engine.close()


def test_a_marks_final_generator_sends_each_chunk_at_once() -> None:
    release = threading.Event()
    engine = engine_for(marks_final(gated(release)))
    engine.add_request("r", None)
    assert triples(wait_for_outputs(engine, 1)) == [("first", False, None)]  # before the gate
    release.set()
    assert triples(wait_for_outputs(engine, 1)) == [("last", True, None)]
    engine.close()


def test_a_generator_yielding_nothing_sends_a_finished_none() -> None:
    def nothing(_data: Any) -> Iterator[Any]:
        yield from ()

    engine = engine_for(marks_final(nothing))
    engine.add_request("r", None)
    assert triples(drain(engine, "r")) == [(None, True, None)]
    engine.close()


def test_an_async_generator_is_driven_too() -> None:
    async def agen(data: list[str]) -> AsyncIterator[Any]:
        for i, item in enumerate(data):
            yield Final(item) if i == len(data) - 1 else item

    engine = engine_for(agen)
    engine.add_request("r", ["a", "b"])
    assert triples(drain(engine, "r")) == [("a", False, None), ("b", True, None)]
    engine.close()


@pytest.mark.parametrize("held", [False, True], ids=["marks_final", "holding one back"])
def test_finals_reason_reaches_the_last_output_of_a_generator_or_a_function(held: bool) -> None:
    def cut(data: str) -> Iterator[Any]:
        yield "a"
        yield Final(data, "length")

    def whole(data: str) -> Any:
        return Final(data, "stop")

    engine = engine_for(cut if held else marks_final(cut))
    engine.add_request("r", "b")
    outs = drain(engine, "r")
    assert [(o.data, o.finished, o.finish_reason) for o in outs] == [
        ("a", False, None),
        ("b", True, "length"),
    ]
    engine.close()
    engine = engine_for(whole)
    engine.add_request("r", "c")
    assert [(o.data, o.finish_reason) for o in drain(engine, "r")] == [("c", "stop")]
    engine.close()


@pytest.mark.parametrize("count", [-1, 2**32, True, 1.0, "5", None])
def test_token_counts_the_wire_would_refuse_are_refused_where_they_are_made(count: Any) -> None:
    """Else the request's last output would be dead-lettered, and the request would wait
    out its deadline."""
    with pytest.raises(ValueError, match=r"must be an int in 0\.\.4294967295"):
        TokenUsage(count, 1)
    with pytest.raises(ValueError, match="completion_tokens"):
        TokenUsage(1, count)
    with pytest.raises(ValueError, match="cached_tokens"):
        TokenUsage(1, 1, count)
    assert TokenUsage.read(3, None) is None and TokenUsage.read(3, 4) == TokenUsage(3, 4)


def test_cached_tokens_are_some_of_the_prompts() -> None:
    with pytest.raises(ValueError, match="cached_tokens 4 > prompt_tokens"):
        TokenUsage(3, 1, 4)
    assert TokenUsage.read(3, 4, 2) == TokenUsage(3, 4, 2)
    assert TokenUsage.read(3, 4, 9) == TokenUsage(3, 4, 3)  # a peer's message, as read


def test_an_exception_ends_only_its_request_with_an_error() -> None:
    def gen(data: str) -> Iterator[Final]:
        if data == "bad":
            raise ValueError("refusing bad")
        yield Final(data)

    engine = engine_for(gen)
    engine.add_request("bad", "bad")
    engine.add_request("good", "ok")
    bad = drain(engine, "bad")
    assert bad[-1].finished and bad[-1].error == "ValueError: refusing bad"
    assert bad[-1].error_code is None  # the stage's own failure
    engine.close()


def test_a_refused_request_ends_with_the_refusals_code() -> None:
    def gen(data: str) -> Iterator[Final]:
        raise RequestRefused(f"cannot hear {data!r}", "invalid_audio")
        yield Final(data)

    engine = engine_for(gen)
    engine.add_request("r", "noise")
    out = drain(engine, "r")[-1]
    assert (out.finished, out.error_code) == (True, "invalid_audio")
    assert out.error == "RequestRefused: cannot hear 'noise'"
    engine.close()
    for bad in ("Invalid", "", "a-b", "x" * 65, "ok\n"):  # what the wire would refuse
        with pytest.raises(ValueError, match="RequestRefused code"):
            RequestRefused("no", bad)


def test_abort_stops_a_request_waiting_for_input() -> None:
    stream = ChunkStream()
    ended = threading.Event()

    @marks_final
    def echo(data: ChunkStream) -> Iterator[Any]:
        try:
            yield from data
        finally:
            ended.set()  # the stage code has stopped: nothing more can come out

    engine = engine_for(echo)
    engine.add_request("r", stream)
    stream.extend(["a"], closed=False)
    assert triples(wait_for_outputs(engine, 1)) == [("a", False, None)]
    engine.abort("r")  # the stage is blocked waiting for its next chunk
    assert ended.wait(10), "the aborted stage kept running"
    stream.extend(["b"], closed=True)
    assert engine.step() == []  # nothing of an aborted request comes out
    engine.close()


def test_with_last_knows_the_last_item_of_a_list_and_of_a_chunk_stream() -> None:
    assert list(with_last([1, 2, 3])) == [(1, False), (2, False), (3, True)]
    assert list(with_last([])) == []
    stream = ChunkStream()
    stream.extend([1, 2], closed=False)
    stream.extend([3], closed=True)
    assert list(with_last(stream)) == [(1, False), (2, False), (3, True)]


def test_chunk_stream_take_never_blocks_and_returns_only_what_is_new() -> None:
    stream = ChunkStream()
    assert stream.take() == [] and not stream.closed
    stream.extend([1, 2], closed=False)
    assert stream.take() == [1, 2]
    stream.extend([3], closed=True)
    assert stream.take() == [3] and stream.closed
    assert stream.take() == []


async def test_async_iteration_of_a_chunk_stream_waits_without_blocking_its_loop() -> None:
    stream = ChunkStream()
    got: list[tuple[Any, bool]] = []

    async def read() -> None:
        async for pair in stream.aiter_with_last():
            got.append(pair)

    reader = asyncio.create_task(read())
    ticks = 0
    while ticks < 20:  # the loop runs other tasks while the reader waits
        await asyncio.sleep(0.001)
        ticks += 1
    assert got == [] and not reader.done()
    feeder = threading.Thread(target=stream.extend, args=([1, 2], False))
    feeder.start()
    await wait_for(lambda: len(got) == 2)
    assert got == [(1, False), (2, False)]
    threading.Thread(target=stream.extend, args=([3], True)).start()
    await asyncio.wait_for(reader, 10)
    assert got[-1] == (3, True)
    assert [x async for x in stream] == [1, 2, 3]  # iterated again: from the start
    feeder.join()


async def test_async_iteration_of_an_aborted_chunk_stream_raises_request_aborted() -> None:
    stream = ChunkStream(["a"])
    seen: list[Any] = []

    async def read() -> None:
        async for item in stream:
            seen.append(item)

    reader = asyncio.create_task(read())
    await wait_for(lambda: seen == ["a"])
    threading.Thread(target=stream.abort).start()
    with pytest.raises(RequestAborted):
        await asyncio.wait_for(reader, 10)
    assert not stream._listeners, "an ended iteration stops listening"


def test_close_after_requests_ended_leaves_no_pool_thread_behind() -> None:
    """A clean shutdown joins the pool: idle threads must not pass for stuck stage code."""
    engine = engine_for(lambda data: data)
    engine.add_request("r", "x")
    assert triples(drain(engine, "r")) == [("x", True, None)]
    engine.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("stage")]


def test_close_with_stage_code_that_ignores_its_abort_says_so_and_does_not_wait_on_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate, started = threading.Event(), threading.Event()

    def stubborn(data: Any) -> Any:
        started.set()
        gate.wait(30)  # ignores the abort
        return data

    engine = engine_for(stubborn)
    engine.add_request("r", "x")
    assert started.wait(10)
    t0 = time.monotonic()
    engine.close()
    assert time.monotonic() - t0 < 10  # the grace period, not the stage code
    assert "stage code still running on 1 pool thread(s) after close" in caplog.text
    stuck = [t for t in threading.enumerate() if t.name.startswith("stage")]
    assert stuck and all(t.daemon for t in stuck)  # it cannot keep the process alive
    gate.set()
    for t in stuck:  # released, it ends: no stage thread outlives the test
        t.join(10)
    assert not any(t.is_alive() for t in stuck)
