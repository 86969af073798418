"""Quick stage calls run on the thread whose pass starts them (`LoopTurn.defer`), after
the pass lets go of the lock; slow calls, the first call, and calls on a chunk stream
keep going to the pool."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from omni_runtime.stage_api import ChunkStream, EngineOutput
from omni_runtime.worker.engines import GeneratorEngine
from omni_runtime.worker.turn import LoopTurn

WAIT_S = 5.0


def on_thread(name: str, fn: Callable[[], None]) -> None:
    t = threading.Thread(target=fn, name=name)
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive()


def test_defer_is_refused_outside_a_delivered_pass() -> None:
    turn = LoopTurn(lambda: None, threading.Event())
    turn.shared = True
    assert turn.defer(lambda: None) is False
    with turn.lock:  # the loop's own pass: its thread must not run stage code
        assert turn.defer(lambda: None) is False


def test_a_deferred_call_runs_on_the_delivering_thread_after_the_pass() -> None:
    seen: list[tuple[str, bool]] = []
    turn: LoopTurn

    def call() -> None:
        seen.append((threading.current_thread().name, turn.lock.locked()))

    def run_pass() -> None:
        turn.defer(call)

    turn = LoopTurn(run_pass, threading.Event())
    turn.shared = True
    on_thread("input-reader", turn.deliver)
    assert seen == [("input-reader", False)]


def test_chained_deferrals_run_in_a_loop_not_by_recursion() -> None:
    """Each call delivers again and its pass defers the next one, as a backlog of quick
    inputs does: far more of them than the interpreter's recursion limit, all in order."""
    n = 5000
    done: list[int] = []
    turn: LoopTurn

    def call(i: int) -> None:
        done.append(i)
        if i + 1 < n:
            nexts.append(i + 1)
            turn.deliver()

    nexts = [0]

    def run_pass() -> None:
        while nexts:
            i = nexts.pop()
            turn.defer(functools.partial(call, i))

    turn = LoopTurn(run_pass, threading.Event())
    turn.shared = True
    on_thread("input-reader", turn.deliver)
    assert done == list(range(n))


class Stage:
    """A `GeneratorEngine` driven by a `LoopTurn` as a worker drives it: a pass hands the
    pending inputs to the engine and takes its outputs."""

    def __init__(self, fn: Callable[..., Any], quick_call_s: float = 0.001) -> None:
        self.pending: list[tuple[str, Any]] = []
        self.outputs: list[EngineOutput] = []
        self.arrived = threading.Condition()
        self.wake = threading.Event()
        self.turn = LoopTurn(self._pass, self.wake)
        self.turn.shared = True
        self.engine = GeneratorEngine(
            fn, {}, 4, self.wake.set, self.turn.deliver, self.turn.defer, quick_call_s
        )

    def _pass(self) -> None:
        while self.pending:
            self.engine.add_request(*self.pending.pop(0))
        with self.arrived:
            self.outputs.extend(self.engine.step())
            self.arrived.notify_all()

    def request(self, rid: str, data: Any) -> None:
        """Deliver one input from a thread named like a worker's input reader."""
        self.pending.append((rid, data))
        on_thread("input-reader", self.turn.deliver)

    def output_of(self, rid: str) -> EngineOutput:
        with self.arrived:
            assert self.arrived.wait_for(
                lambda: any(o.request_id == rid for o in self.outputs), WAIT_S
            )
        return next(o for o in self.outputs if o.request_id == rid)


def where(data: Any, delay_s: float = 0.0) -> str:
    if delay_s:
        time.sleep(delay_s)  # the stage's own work (a slow stage), not a wait on anything
    if isinstance(data, ChunkStream):
        list(data)
    return threading.current_thread().name


def test_a_quick_stage_runs_its_calls_on_the_delivering_thread() -> None:
    stage = Stage(where)
    stage.request("first", 1)  # nothing timed yet: the pool
    assert stage.output_of("first").data.startswith("stage_")
    stage.request("second", 2)
    out = stage.output_of("second")
    assert (out.data, out.finished) == ("input-reader", True)
    stage.engine.close()


def test_a_slow_stage_keeps_the_pool() -> None:
    stage = Stage(lambda data: where(data, delay_s=0.005))
    for rid in ("a", "b", "c"):
        stage.request(rid, rid)
        assert stage.output_of(rid).data.startswith("stage_")
    stage.engine.close()


def test_a_call_on_a_chunk_stream_keeps_the_pool() -> None:
    stage = Stage(where)
    stage.request("timed", 0)
    stage.output_of("timed")
    stage.request("stream", ChunkStream(["x"], closed=True))
    assert stage.output_of("stream").data.startswith("stage_")
    stage.engine.close()


def test_a_threshold_of_zero_keeps_every_call_on_the_pool() -> None:
    """`OMNI_WORKER_QUICK_CALL_MS=0`."""
    stage = Stage(where, quick_call_s=0.0)
    for rid in ("a", "b", "c"):
        stage.request(rid, rid)
        assert stage.output_of(rid).data.startswith("stage_")
    stage.engine.close()
