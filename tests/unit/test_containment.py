"""A request can fail only itself: an exception while the orchestrator core, the durable-state
writer or a worker handles one request ends that request with one error final, is counted
(`omni_contained_errors_total`) and logged with its id, and every other request goes on."""

from __future__ import annotations

import logging
import time
from typing import Any

import fakeredis
import pytest

from omni_runtime import Orchestrator, OrchOutput, keys
from omni_runtime.core.loops import Hooks
from omni_runtime.core.orchestrator import StreamingOrchestrator
from omni_runtime.core.types import ReqState
from omni_runtime.observe.metrics import Metrics
from omni_runtime.orchestrator.request_store import RequestStore
from omni_runtime.redis_io.write_ops import ExpireAt, HashPut
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageOutputMsg
from omni_runtime.wire.outgoing import DurableRequestOut
from tests.fakes import identity_forward, seed_stages
from tests.unit.test_worker_core import inp, make
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(30)


def contained(metrics: Metrics) -> float:
    return metrics.value("omni_contained_errors_total")


async def outputs_of(orch: Orchestrator, n: int) -> dict[str, list[OrchOutput]]:
    by_request: dict[str, list[OrchOutput]] = {}
    finals = 0
    while finals < n:
        out = await orch.next_output(timeout=10)
        by_request.setdefault(out.request_id, []).append(out)
        finals += out.finished
    return by_request


def forward_failing_on(bad: str) -> Any:
    def forward(next_stage: int, prompt: Any, previous: list[Any]) -> Any:
        if prompt == bad:
            raise ArithmeticError("forward cannot take it")
        return previous

    return forward


async def test_a_forward_fn_that_raises_fails_its_request_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = Metrics()
    async with Orchestrator(seed_stages(), {2}, forward_failing_on("x y"), metrics=metrics) as orch:
        for rid, prompt in [("a", "a b"), ("bad", "x y"), ("c", "c")]:
            await orch.add_request(rid, prompt)
        with caplog.at_level(logging.ERROR):
            outs = await outputs_of(orch, 3)
            for rid, prompt in [("d", "d")]:  # the dispatcher goes on
                await orch.add_request(rid, prompt)
            outs.update(await outputs_of(orch, 1))
        assert [(o.data, o.error) for o in outs["a"]] == [("wav:A", None), ("wav:B", None)]
        (bad,) = outs["bad"]
        assert bad.finished and bad.data is None and bad.error is not None
        assert bad.error.startswith("internal error: ArithmeticError: forward cannot take it")
        assert [o.data for o in outs["d"]] == ["wav:D"]
        assert orch.request_states == {}
    assert contained(metrics) == 1
    assert any(getattr(r, "request_id", None) == "bad" for r in caplog.records)


@pytest.mark.parametrize("kind", [Orchestrator, StreamingOrchestrator])
async def test_a_sink_that_raises_on_one_output_fails_that_request_with_one_final(
    kind: type[Orchestrator],
) -> None:
    """The user output of one request cannot be handed over (its sink raises): that
    request ends with one error final instead; the others are delivered."""
    got: list[OrchOutput] = []

    def sink(out: OrchOutput) -> None:
        if out.request_id == "bad" and out.error is None:
            raise ValueError("cannot write this one")
        got.append(out)

    metrics = Metrics()
    orch = kind(seed_stages(), {2}, identity_forward, metrics=metrics, hooks=Hooks(sink))
    async with orch:
        await orch.add_request("bad", "poison")
        await orch.add_request("good", "fine")
        await wait_for(lambda: sum(o.finished for o in got) == 2)
        bad = [o for o in got if o.request_id == "bad"]
        assert len(bad) == 1 and bad[0].finished and "ValueError" in (bad[0].error or "")
        assert [o.finished for o in got if o.request_id == "good"][-1]
        assert all(o.error is None for o in got if o.request_id == "good")
        assert orch.request_states == {}
    assert contained(metrics) == 1


async def test_an_add_that_raises_before_registering_still_gets_one_final() -> None:
    orch = Orchestrator(seed_stages(), {2}, identity_forward)

    def exploding_register(*_args: Any) -> None:
        raise RuntimeError("registry broke")

    async with orch:
        orch._register = exploding_register  # type: ignore[method-assign, assignment]
        await orch.add_request("r", "a")
        out = await orch.next_output(timeout=10)
        assert out.request_id == "r" and out.finished
        assert out.error == "internal error: RuntimeError: registry broke"
        with pytest.raises(TimeoutError):
            await orch.next_output(timeout=0.2)  # one final, no more


def test_a_state_that_cannot_be_written_fails_its_request_alone() -> None:
    """Its deadline out of Redis's range, or its data not encodable: that request is told
    (`failed`); the batch carries every other state, with an expiry Redis takes."""
    now = time.time()
    failed: list[tuple[str, str]] = []
    docs: dict[str, Any] = {"good": now + 10, "inf": float("inf"), "nan": float("nan")}

    def describe(rid: str, state: ReqState) -> DurableRequestOut:
        if rid == "broken":
            raise KeyError("describe broke")
        return DurableRequestOut(
            request_id=rid,
            client_id="c1",
            prompt=state.prompt,
            deadline_at=docs.get(rid, now + 5),
            submitted=[0],
            finished=[],
        )

    writer = StreamWriter(fakeredis.FakeAsyncRedis(), maxlen=100)
    store = RequestStore(
        writer, keys.Names("t"), 0, describe, failed=lambda rid, e: failed.append((rid, repr(e)))
    )
    deep: Any = 0
    for _ in range(100):
        deep = [deep]
    for rid in ("good", "inf", "nan", "broken"):
        store.changed(rid, ReqState(prompt="p"))
    store.changed("deep", ReqState(prompt=deep))
    ops = store.ops()
    assert [type(op) for op in ops] == [HashPut, ExpireAt]
    assert isinstance(ops[0], HashPut) and set(ops[0].fields) == {"good"}
    assert isinstance(ops[1], ExpireAt) and ops[1].at_ms == int((now + 10 + 60) * 1000)
    assert [rid for rid, _ in failed] == ["inf", "nan", "broken", "deep"]
    assert "out of range" in failed[0][1] and "nested deeper" in failed[3][1]


def test_a_worker_input_whose_chunks_break_fails_that_request_alone() -> None:
    core, _engine = make(streaming=True)
    core.on_input(inp("bad", streaming=True), 0.0)
    core.on_input(inp("good", streaming=True), 0.0)
    core.take_actions()
    core.on_chunks({"bad": [{"no data": 1}], "good": [{"data": "x", "finished": True}]}, 1.0)
    actions = core.take_actions()
    (out,) = actions.outputs
    msg = codec.decode_model(out.payload, StageOutputMsg)
    assert (out.request_id, out.ends, out.is_error) == ("bad", True, True)
    assert msg.error is not None and "internal error: KeyError" in msg.error
    assert core.is_active("good") and not core.is_active("bad")
    assert contained(core.metrics) == 1


def test_a_worker_error_longer_than_a_message_may_carry_is_cut() -> None:
    core, engine = make()
    engine.fail_on["add_request"] = ValueError("x" * 10_000)
    core.on_input(inp("r"), 0.0)
    (out,) = core.take_actions().outputs
    msg = codec.decode_model(out.payload, StageOutputMsg)
    assert msg.error is not None and len(msg.error) == 4000 and msg.error.endswith("…")
