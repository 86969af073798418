"""WorkerCore: a request's life on a worker, with an in-memory engine and no Redis."""

from __future__ import annotations

from typing import Any

import fakeredis
import msgspec
import numpy as np
import pytest

from omni_runtime import keys
from omni_runtime.chunks.redis import RedisConnector
from omni_runtime.chunks.transport import ChunkRejected
from omni_runtime.observe.metrics import Metrics
from omni_runtime.stage_api import EngineOutput, StepFailed
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageInputMsg, StageOutputMsg
from omni_runtime.worker.actions import Actions, Input
from omni_runtime.worker.core import WorkerCore

pytestmark = pytest.mark.timeout(30)


class ListEngine:
    """A step engine: each request echoes its data, one chunk per item, the last finished.

    `fail_on` makes a method raise for (or, for `step`, when holding) that request.
    """

    def __init__(self) -> None:
        self.queues: dict[str, list[Any]] = {}
        self.aborted: list[str] = []
        self.fail_on: dict[str, Exception] = {}

    def add_request(self, request_id: str, data: Any) -> None:
        if "add_request" in self.fail_on:
            raise self.fail_on["add_request"]
        self.queues[request_id] = list(data) if isinstance(data, list) else [data]

    def has_work(self) -> bool:
        if "has_work" in self.fail_on:
            raise self.fail_on["has_work"]
        return any(self.queues.values())

    def step(self) -> list[EngineOutput]:
        if "step" in self.fail_on:
            raise self.fail_on["step"]
        outs = []
        for rid, q in list(self.queues.items()):
            if q:
                outs.append(EngineOutput(rid, q.pop(0), finished=not q))
                if not q:
                    del self.queues[rid]
        return outs

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if "abort" in self.fail_on:
            raise self.fail_on["abort"]
        self.queues.pop(request_id, None)


def make(
    engine: ListEngine | None = None, streaming: bool = False, **kw: Any
) -> tuple[WorkerCore, ListEngine]:
    engine = engine or ListEngine()
    core = WorkerCore(
        engine,
        1,
        "upper",
        sends_chunks=kw.pop("sends_chunks", streaming),
        receives_chunks=kw.pop("receives_chunks", streaming),
        max_message_bytes=kw.pop("max_message_bytes", 1 << 20),
        input_timeout_s=kw.pop("input_timeout_s", 10.0),
        metrics=Metrics(),
        **kw,
    )
    return core, engine


def inp(rid: str, data: Any = "x", entry: bytes | None = None, streaming: bool = False) -> Input:
    msg = StageInputMsg(request_id=rid, data=data, streaming=streaming)
    return Input(entry or f"{rid}-0".encode(), msg)


def published(actions: Actions) -> list[tuple[str, int, Any, bool, str | None]]:
    msgs = [codec.decode_model(o.payload, StageOutputMsg) for o in actions.outputs]
    return [(m.request_id, m.seq, m.data, m.finished, m.error) for m in msgs]


def saved(actions: Actions) -> list[tuple[str, Any, bool]]:
    """The chunks the shell is to save, their data decoded (the core encodes it once)."""
    return [(rid, codec.decode(bytes(raw)), last) for rid, raw, last in actions.chunk_saves]


def test_outputs_carry_per_request_sequence_numbers_and_the_final_acks_its_input() -> None:
    core, _ = make()
    core.on_input(inp("a", [1, 2, 3]), now=0)
    core.on_input(inp("b", ["only"]), now=0)
    while core.step():
        pass
    actions = core.take_actions()
    assert sorted(published(actions)) == [
        ("a", 0, 1, False, None),
        ("a", 1, 2, False, None),
        ("a", 2, 3, True, None),
        ("b", 0, "only", True, None),
    ]
    assert sorted(o.ack for o in actions.outputs if o.ack) == [b"a-0", b"b-0"]
    assert actions.freed_slots == 2 and core.in_flight == 0
    assert core.metrics.value("omni_requests_completed_total", stage=1) == 2


def test_a_redelivered_input_of_a_running_request_is_only_acknowledged() -> None:
    core, engine = make()
    core.on_input(inp("a", [1, 2]), now=0)
    core.on_input(inp("a", [1, 2], entry=b"again"), now=0)
    actions = core.take_actions()
    assert actions.acks == [b"again"] and actions.freed_slots == 1
    assert core.in_flight == 1 and engine.queues == {"a": [1, 2]}


def test_its_own_input_read_again_is_left_pending_while_it_runs() -> None:
    """A failed read walks the worker's backlog again, which holds what it runs: acked
    then, a running request's input would not be taken over if this worker died."""
    core, engine = make()
    core.on_input(inp("a", [1, 2]), now=0)
    core.on_input(inp("a", [1, 2]), now=0)  # the same entry
    actions = core.take_actions()
    assert actions.acks == [] and actions.freed_slots == 1
    assert core.in_flight == 1 and engine.queues == {"a": [1, 2]}


def test_an_abort_drops_the_request_and_its_late_input() -> None:
    core, engine = make()
    core.on_input(inp("a", [1, 2]), now=0)
    core.on_abort("a", now=1)
    actions = core.take_actions()
    assert engine.aborted == ["a"] and actions.discards == ["a"] and actions.acks == [b"a-0"]
    assert actions.outputs == [] and actions.freed_slots == 1
    core.on_abort("late", now=1)  # abort before its input arrives
    core.on_input(inp("late"), now=2)
    assert core.take_actions().acks == [b"late-0"] and core.in_flight == 0
    assert core.metrics.value("omni_aborts_total", stage=1) == 1


def test_a_receiving_stage_discards_an_aborted_request_whose_input_has_not_arrived() -> None:
    """Else its upstream's chunks, which nobody will read, would wait for their TTL."""
    core, _ = make(streaming=True)
    core.on_abort("early", now=0)
    core.on_abort("early", now=0)  # the abort of another stage, broadcast as well
    assert core.take_actions().discards == ["early"]
    plain, _ = make(streaming=False)
    plain.on_abort("early", now=0)
    assert plain.take_actions().discards == []


def test_remembered_aborts_are_bounded_in_number_and_age() -> None:
    core, _ = make(abort_memory_s=60, abort_memory_max=3)
    for i in range(5):
        core.on_abort(f"r{i}", now=i)
    assert core.remembered_aborts == 3
    core.on_input(inp("r0"), now=5)  # forgotten: runs
    assert core.is_active("r0")
    core.tick(now=63.5)  # r2, r3 older than 60 s
    assert core.remembered_aborts == 1


def test_streaming_inputs_get_a_chunk_stream_and_time_out_when_upstream_goes_silent() -> None:
    core, engine = make(streaming=True, input_timeout_s=0.5)
    core.on_input(inp("s", None, streaming=True), now=0)
    assert core.take_actions().receiver_loads == ["s"]
    assert core.on_chunks({"s": [{"data": "c0", "finished": False}]}, now=0.4)
    core.tick(now=0.8)
    assert core.is_active("s")  # 0.4 s since the last chunk
    core.tick(now=1.0)
    actions = core.take_actions()
    assert published(actions) == [
        ("s", 0, None, True, "no input from stage 0 within 0.5s (OMNI_INPUT_TIMEOUT_S)")
    ]
    assert engine.aborted == ["s"] and actions.discards == ["s"]
    assert actions.receiver_cleanups == ["s"] and not core.is_active("s")


def test_streaming_outputs_are_saved_as_chunks_and_errors_discard_them() -> None:
    core, engine = make(sends_chunks=True)  # a sending stage that reads its input whole
    core.on_input(inp("a", [1, 2]), now=0)
    while core.step():
        pass
    actions = core.take_actions()
    assert saved(actions) == [("a", 1, False), ("a", 2, True)]
    assert actions.receiver_cleanups == [] and actions.discards == []
    core.on_input(inp("b", [3]), now=0)
    engine.fail_on["step"] = StepFailed(["b"], "bad")
    core.step()
    actions = core.take_actions()
    assert actions.chunk_saves == [] and actions.discards == ["b"]


def test_a_streaming_stage_that_is_not_final_reports_only_its_end_and_without_data() -> None:
    """Its chunks carry its outputs on; the orchestrator needs only its end (SPEC §6)."""
    core, _engine = make(sends_chunks=True, reports_outputs=False)
    core.on_input(inp("a", [1, 2, 3]), now=0)
    while core.step():
        pass
    actions = core.take_actions()
    assert saved(actions) == [("a", 1, False), ("a", 2, False), ("a", 3, True)]
    assert published(actions) == [("a", 2, None, True, None)]
    assert [o.ack for o in actions.outputs] == [b"a-0"]
    core.on_input(inp("b", [{1, 2}]), now=0)  # what cannot travel still fails its request
    core.step()
    ((rid, _seq, data, finished, error),) = published(core.take_actions())
    assert (rid, data, finished) == ("b", None, True) and error is not None


def test_an_output_that_cannot_travel_fails_its_request() -> None:
    core, engine = make()
    core.on_input(inp("a", [{1, 2}, "never"]), now=0)
    core.step()
    actions = core.take_actions()
    ((rid, seq, data, finished, error),) = published(actions)
    assert (rid, seq, data, finished) == ("a", 0, None, True)
    assert error is not None and error.startswith("output cannot be sent")
    assert engine.aborted == ["a"]
    assert core.metrics.value("omni_requests_failed_total", stage=1) == 1


def test_an_outputs_data_is_encoded_once_for_its_output_and_its_chunk() -> None:
    """The output message and the chunk carry the same bytes; the chunk is written around
    them exactly as a chunk encoded whole would be."""
    pcm = np.arange(6, dtype=np.float32)
    core, _engine = make(sends_chunks=True)  # reports its outputs and sends chunks
    core.on_input(inp("a", [{"pcm": pcm, "text": "hi"}]), now=0)
    core.step()
    actions = core.take_actions()
    ((_rid, raw, last),) = actions.chunk_saves
    (out,) = actions.outputs
    assert isinstance(raw, msgspec.Raw) and bytes(raw) in out.payload
    msg = codec.decode_model(out.payload, StageOutputMsg)
    np.testing.assert_array_equal(msg.data["pcm"], pcm)
    server = fakeredis.FakeServer()
    connector = RedisConnector(fakeredis.FakeRedis(server=server), ttl_s=60)
    connector.put_batch([("a_1_0", {"data": raw, "finished": last}, True)])
    stored = fakeredis.FakeRedis(server=server).get(keys.stored_chunk_key("a_1_0", ""))
    assert stored == codec.encode({"data": {"pcm": pcm, "text": "hi"}, "finished": True})


@pytest.mark.parametrize("size", [99, 100, 101])
def test_a_chunk_the_orchestrator_will_not_see_is_held_to_the_chunks_own_limit(size: int) -> None:
    """What its transport would refuse fails the request here, and nothing else does."""
    envelope = len(codec.encode({"data": "x" * 40, "finished": True})) - 40  # a str8
    text = "x" * (size - envelope)
    chunk = {"data": text, "finished": True}
    assert len(codec.encode(chunk)) == size
    core, _engine = make(sends_chunks=True, reports_outputs=False, max_message_bytes=100)
    core.on_input(inp("a", [text]), now=0)
    core.step()
    actions = core.take_actions()
    ((_rid, _seq, _data, finished, error),) = published(actions)
    assert finished and (error is None) == (size <= 100)
    connector = RedisConnector(fakeredis.FakeRedis(), ttl_s=60, max_bytes=100)
    if size <= 100:
        ((_rid, raw, last),) = actions.chunk_saves
        connector.put_batch([("a_1_0", {"data": raw, "finished": last}, True)])
        assert connector.get("a_1_0") == chunk
    else:
        assert actions.chunk_saves == [] and "output cannot be sent" in str(error)
        with pytest.raises(ChunkRejected):
            connector.put_batch([("a_1_0", chunk, True)])


def test_a_step_that_raises_with_no_reset_and_no_factory_fails_every_request_it_holds() -> None:
    core, engine = make()
    core.on_input(inp("a", [1, 2]), now=0)
    core.on_input(inp("b", [3, 4]), now=0)
    engine.fail_on["step"] = RuntimeError("kaput")
    assert core.step()
    failed = published(core.take_actions())
    assert sorted(failed) == [
        ("a", 0, None, True, "upper step() raised RuntimeError: kaput"),
        ("b", 0, None, True, "upper step() raised RuntimeError: kaput"),
    ]
    assert sorted(engine.aborted) == ["a", "b"] and core.in_flight == 0
    del engine.fail_on["step"]
    core.on_input(inp("c", ["ok"]), now=1)
    core.step()
    assert published(core.take_actions()) == [("c", 0, "ok", True, None)]


def test_step_failed_names_the_requests_it_concerns() -> None:
    core, engine = make()
    core.on_input(inp("a", [1, 2]), now=0)
    core.on_input(inp("b", [3, 4]), now=0)
    engine.fail_on["step"] = StepFailed(["b"], "bad batch")
    core.step()
    assert published(core.take_actions()) == [
        ("b", 0, None, True, "upper step() failed: bad batch")
    ]
    assert core.is_active("a") and not core.is_active("b")


@pytest.mark.parametrize("method", ["add_request", "has_work"])
def test_a_raising_engine_method_fails_the_requests_concerned(method: str) -> None:
    core, engine = make()
    if method == "has_work":
        core.on_input(inp("a", [1]), now=0)
    engine.fail_on[method] = ValueError("nope")
    core.on_input(inp("b", [2], entry=b"b-entry"), now=0)
    core.step()
    actions = core.take_actions()
    expected = ["a", "b"] if method == "has_work" else ["b"]
    assert [p[0] for p in sorted(published(actions))] == expected
    assert all(p[4] == f"upper {method}() raised ValueError: nope" for p in published(actions))
    assert b"b-entry" in [o.ack for o in actions.outputs]
    assert core.in_flight == 0


def test_an_abort_that_raises_still_drops_the_request() -> None:
    core, engine = make()
    core.on_input(inp("a", [1]), now=0)
    engine.fail_on["abort"] = KeyError("a")
    core.on_abort("a", now=0)
    assert not core.is_active("a") and core.take_actions().acks == [b"a-0"]


def test_lost_outputs_end_their_requests_with_an_error_output() -> None:
    core, engine = make()
    core.on_input(inp("running", [1, 2, 3]), now=0)
    core.on_input(inp("ended", ["z"]), now=0)
    core.step()
    lost = core.take_actions().outputs  # running seq 0, ended seq 0 (its final)
    core.on_publish_failed(lost, "Redis unreachable")
    actions = core.take_actions()
    error = "stage 1 output lost: Redis unreachable"
    assert sorted(published(actions)) == [
        ("ended", 1, None, True, error),
        ("running", 1, None, True, error),
    ]
    assert sorted(o.ack for o in actions.outputs if o.ack) == [b"ended-0", b"running-0"]
    assert engine.aborted == ["running"] and core.in_flight == 0
    core.on_publish_failed(actions.outputs, "still down")  # the error outputs lost as well
    assert core.take_actions().outputs == []


@pytest.mark.parametrize(
    ("ours", "theirs"), [("sequential", "streaming"), ("streaming", "sequential")]
)
def test_an_input_from_an_orchestrator_in_the_other_mode_fails_naming_both(
    ours: str, theirs: str
) -> None:
    core, engine = make(streaming=ours == "streaming")
    core.on_input(inp("a", None, streaming=theirs == "streaming"), now=0)
    actions = core.take_actions()
    error = (
        f"the orchestrator runs {theirs} mode, this worker of stage 1 runs {ours}: "
        "start both with the same --mode"
    )
    assert published(actions) == [("a", 0, None, True, error)]
    assert [o.ack for o in actions.outputs] == [b"a-0"] and actions.freed_slots == 1
    assert engine.queues == {} and core.in_flight == 0
    assert core.metrics.value("omni_requests_failed_total", stage=1) == 1


def test_stage_0_inputs_never_carry_the_mode() -> None:
    """The orchestrator sends stage 0 its prompt whole in both modes."""
    core, _ = make(sends_chunks=True)
    core.on_input(inp("a", ["x"]), now=0)
    assert core.is_active("a")
