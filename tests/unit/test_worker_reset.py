"""WorkerCore around a step engine whose step() raises: reset or rebuilt, the step's requests
run again, the poison ends alone, and no output reaches the orchestrator twice."""

from __future__ import annotations

from typing import Any

import pytest

from omni_runtime.observe.metrics import Metrics
from omni_runtime.pipeline import StageConfig
from omni_runtime.stage_api import ChunkStream, EngineOutput, StageEngine
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageInputMsg, StageOutputMsg
from omni_runtime.worker.actions import Input
from omni_runtime.worker.core import WorkerCore
from omni_runtime.worker.engines import engine_factory
from tests.faults.poison import BatchPoisonEngine

pytestmark = pytest.mark.timeout(30)


class BatchEngine:
    """Continuous batching: every step, each request it holds emits its next item (the
    last finished); a step raises `RuntimeError` while it holds an input with "poison".
    A `ChunkStream` input is read with `take`: it ends once closed and emptied."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.reqs: dict[str, tuple[Any, list[Any]]] = {}
        self.closed = False
        self.steps = 0

    def add_request(self, request_id: str, data: Any) -> None:
        self.reqs[request_id] = (data, [] if isinstance(data, ChunkStream) else list(data))

    def has_work(self) -> bool:
        return any(self._poll(data, pending) for data, pending in self.reqs.values())

    def _poll(self, data: Any, pending: list[Any]) -> bool:
        """Move new chunks into `pending`; True if the request has something to emit."""
        if not isinstance(data, ChunkStream):
            return bool(pending)
        closed = data.closed  # before take: closed then means nothing more will come
        pending.extend(data.take())
        return bool(pending) or closed

    def abort(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)

    def close(self) -> None:
        self.closed = True

    def step(self) -> list[EngineOutput]:
        self.steps += 1
        outs = []
        for rid, (data, pending) in list(self.reqs.items()):
            ended = not isinstance(data, ChunkStream) or data.closed
            self._poll(data, pending)
            if "poison" in pending:
                raise RuntimeError(f"bad input in {rid}")
            if not pending:
                continue
            item = pending.pop(0)
            outs.append(EngineOutput(rid, f"{self.tag}{item}", ended and not pending))
            if ended and not pending:
                del self.reqs[rid]
        return outs


class ResettableEngine(BatchEngine):
    def __init__(self) -> None:
        super().__init__()
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1
        self.reqs.clear()


def make(engine: StageEngine, streaming: bool = False, **kw: Any) -> WorkerCore:
    return WorkerCore(
        engine,
        1,
        "batch",
        sends_chunks=False,
        receives_chunks=streaming,
        max_message_bytes=1 << 20,
        input_timeout_s=10.0,
        metrics=Metrics(),
        **kw,
    )


def inp(rid: str, data: Any, streaming: bool = False) -> Input:
    return Input(f"{rid}-0".encode(), StageInputMsg(request_id=rid, data=data, streaming=streaming))


Published = dict[str, list[tuple[int, Any, bool, str | None]]]


def collect(core: WorkerCore, seen: Published) -> Published:
    """The outputs the core published since the last call, by request, in order."""
    for o in core.take_actions().outputs:
        m = codec.decode_model(o.payload, StageOutputMsg)
        seen.setdefault(m.request_id, []).append((m.seq, m.data, m.finished, m.error))
    return seen


def run(core: WorkerCore, seen: Published | None = None, max_steps: int = 1000) -> Published:
    """Step until idle; every published output, by request, in order."""
    seen = {} if seen is None else seen
    for _ in range(max_steps):
        busy = core.step()
        collect(core, seen)
        if not busy and not core.engine.has_work():
            return seen
    raise AssertionError("the core never went idle")


def expected(items: list[str], tag: str = "") -> list[tuple[int, Any, bool, str | None]]:
    return [(i, f"{tag}{item}", i == len(items) - 1, None) for i, item in enumerate(items)]


POISON_ERROR = "batch step() raised RuntimeError: bad input in p (poison: this request was in {n} failed steps)"


def test_a_poison_joining_running_requests_ends_alone_and_the_others_send_each_output_once() -> (
    None
):
    """Requests half done when the poison joins re-run from their start: what they sent is
    not sent again, and each one's seq runs on without a gap."""
    engine = ResettableEngine()
    core = make(engine)
    words = {f"r{i}": [f"w{i}.{k}" for k in range(6)] for i in range(64)}
    for rid, items in words.items():
        core.on_input(inp(rid, items), now=0)
    seen: Published = {}
    for _ in range(3):
        core.step()
    collect(core, seen)
    assert all(len(outs) == 3 for outs in seen.values())
    core.on_input(inp("p", ["x", "poison"]), now=1)
    run(core, seen)
    assert seen.pop("p") == [(0, None, True, POISON_ERROR.format(n=2))]
    assert seen == {rid: expected(items) for rid, items in words.items()}
    assert engine.resets == 2 and core.in_flight == 0
    assert core.metrics.value("omni_engine_resets_total", stage=1) == 2
    assert core.metrics.value("omni_poison_requests_total", stage=1) == 1


def test_one_poison_among_64_arriving_together_costs_1_plus_log2_64_failed_steps() -> None:
    engine = ResettableEngine()
    core = make(engine)
    words = {f"r{i}": [f"w{i}.{k}" for k in range(4)] for i in range(64)}
    for i, (rid, items) in enumerate(words.items()):
        core.on_input(inp(rid, items), now=0)
        if i == 40:
            core.on_input(inp("p", ["poison"]), now=0)
    seen = run(core)
    assert seen.pop("p") == [(0, None, True, POISON_ERROR.format(n=7))]
    assert seen == {rid: expected(items) for rid, items in words.items()}
    assert engine.resets == 7  # 65 requests: 1 + ceil(log2 65) = 8 at most


def test_an_engine_without_reset_is_built_anew_and_the_old_one_closed() -> None:
    built: list[BatchEngine] = []

    def rebuild() -> StageEngine:
        built.append(BatchEngine(tag=f"v{len(built) + 1}:"))
        return built[-1]

    first = BatchEngine(tag="v0:")
    core = make(first, rebuild=rebuild)
    core.on_input(inp("a", ["1", "2", "3"]), now=0)
    core.step()
    core.on_input(inp("p", ["poison"]), now=0)
    seen = run(core)
    assert first.closed and [e.closed for e in built] == [True, False]
    assert core.engine is built[-1]
    # a's first output came from the first engine; its re-runs' copies were not sent again
    assert seen["a"] == [
        (0, "v0:1", False, None),
        (1, "v2:2", False, None),
        (2, "v2:3", True, None),
    ]
    assert seen["p"] == [(0, None, True, POISON_ERROR.format(n=2))]
    core.driver.close()
    assert built[-1].closed


def test_a_streamed_input_is_replayed_to_the_reset_engine_and_keeps_receiving() -> None:
    engine = ResettableEngine()
    core = make(engine, streaming=True)
    core.on_input(inp("s", None, streaming=True), now=0)
    core.on_chunks({"s": [{"data": "a", "finished": False}, {"data": "b", "finished": False}]}, 0)
    seen = run(core)
    assert seen["s"] == [(0, "a", False, None), (1, "b", False, None)]
    core.on_input(inp("p", None, streaming=True), now=1)
    chunk = {"data": "c", "finished": False}
    core.on_chunks({"s": [chunk], "p": [{"data": "poison", "finished": True}]}, 1)
    run(core, seen)
    core.on_chunks({"s": [{"data": "d", "finished": True}]}, 2)
    run(core, seen)
    assert seen["s"] == expected(["a", "b", "c", "d"])
    assert engine.resets == 2 and seen["p"][-1][3] == POISON_ERROR.format(n=2)


def test_a_re_run_that_ends_before_what_was_sent_fails_its_request_saying_so() -> None:
    """A non-deterministic engine: its re-run made fewer outputs than were sent."""
    engine = ResettableEngine()
    core = make(engine)
    core.on_input(inp("a", ["1", "2", "3"]), now=0)
    core.step()
    core.step()
    original = engine.add_request

    def shorter(request_id: str, data: Any) -> None:
        original(request_id, data[:1] if request_id == "a" else data)

    engine.add_request = shorter  # type: ignore[method-assign]
    core.on_input(inp("p", ["poison"]), now=1)
    seen = run(core)
    error = "batch re-run after an engine reset ended after 1 outputs, 2 already sent"
    assert seen["a"] == [(0, "1", False, None), (1, "2", False, None), (2, None, True, error)]


def test_an_engine_that_can_be_neither_reset_nor_rebuilt_fails_every_request_it_holds() -> None:
    class BrokenReset(BatchEngine):
        def reset(self) -> None:
            raise OSError("device lost")

    core = make(BrokenReset())
    core.on_input(inp("a", ["1", "2"]), now=0)
    core.on_input(inp("p", ["poison"]), now=0)
    seen = run(core)
    error = "batch step() raised RuntimeError: bad input in p"
    assert seen == {"a": [(0, None, True, error)], "p": [(0, None, True, error)]}
    assert core.metrics.value("omni_engine_resets_total") == 0


def test_a_held_back_request_that_is_aborted_ends_without_reaching_the_engine() -> None:
    engine = ResettableEngine()
    core = make(engine)
    for rid in ("a", "b", "p", "c"):
        core.on_input(inp(rid, ["poison"] if rid == "p" else ["1", "2"]), now=0)
    core.step()  # fails: a and b go back in, p and c wait
    assert sorted(engine.reqs) == ["a", "b"] and core.in_flight == 4
    core.on_abort("c", now=1)
    actions = core.take_actions()
    assert actions.acks == [b"c-0"] and "c" not in engine.reqs
    seen = run(core)
    assert "c" not in seen and seen["p"][-1][3] is not None
    assert seen["a"] == expected(["1", "2"]) and seen["b"] == expected(["1", "2"])


class AsyncShaped:
    """Not a step engine: no add_request/step/has_work."""

    async def generate(self, request_id: str, data: Any) -> Any:
        return data


def test_the_factory_builds_a_step_engine_anew_with_its_options_and_nothing_else() -> None:
    def stage(entry: str, **options: Any) -> StageConfig:
        return StageConfig(id=1, name="s", entry=entry, options=options)

    build = engine_factory(stage("tests.faults.poison:BatchPoisonEngine", step_ms=3), None)
    assert build is not None
    first, second = build(), build()
    assert first is not second and isinstance(first, BatchPoisonEngine)
    assert isinstance(second, BatchPoisonEngine) and second.step_ms == 3
    assert engine_factory(stage("workers.seed:upper_all"), None) is None
    assert engine_factory(stage("tests.unit.test_worker_reset:AsyncShaped"), None) is None


def test_a_re_admitted_request_gets_its_params_again() -> None:
    class WithParams(ResettableEngine):
        def __init__(self) -> None:
            super().__init__()
            self.params: list[tuple[str, Any]] = []

        def add_request(self, request_id: str, data: Any, params: Any = None) -> None:
            self.params.append((request_id, params))
            super().add_request(request_id, data)

    engine = WithParams()
    core = make(engine)
    msg = StageInputMsg(request_id="a", data=["1", "2"], params={"voice": "x"})
    core.on_input(Input(b"a-0", msg), now=0)
    core.on_input(inp("p", ["poison"]), now=0)
    seen = run(core)
    assert seen["a"] == expected(["1", "2"])
    assert [p for rid, p in engine.params if rid == "a"] == [{"voice": "x"}] * 3
