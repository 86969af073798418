"""Aborts and deadlines (Orchestrator.abort_request, add_request(deadline_s=...),
default_deadline_s), in sequential and streaming mode: one test per rule."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omni_runtime import Orchestrator, OrchOutput, StageOutput
from omni_runtime.core.in_memory import InMemoryStage
from omni_runtime.core.orchestrator import StreamingOrchestrator
from tests.fakes import identity_forward
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

FINALS = {0, 2}


@pytest.fixture(params=[Orchestrator, StreamingOrchestrator], ids=["sequential", "streaming"])
def orch_cls(request: pytest.FixtureRequest) -> type[Orchestrator]:
    cls: type[Orchestrator] = request.param
    return cls


def hand_driven(n: int = 3) -> list[InMemoryStage]:
    """Stages that emit nothing on their own: the test emits every output."""
    return [InMemoryStage() for _ in range(n)]


async def wait_submitted(stage: InMemoryStage, rid: str) -> None:
    await wait_for(lambda: rid in stage.submitted_ids())


async def assert_no_output(orch: Orchestrator, timeout: float = 0.05) -> None:
    with pytest.raises(TimeoutError):
        await orch.next_output(timeout=timeout)


async def handler_barrier(orch: Orchestrator, stage0: InMemoryStage, name: str) -> None:
    """Everything queued on the handler before this (adds, aborts) has been handled: the
    handler takes its queue in FIFO order, one item at a time."""
    await orch.add_request(name, "barrier")
    await wait_for(lambda: name in stage0.submitted_ids())


def expected_submitted(orch: Orchestrator, reached: int) -> list[int]:
    """Stages that hold a request: sequential mode has submitted 0..reached, streaming all."""
    if isinstance(orch, StreamingOrchestrator):
        return list(range(orch.last_stage + 1))
    return list(range(reached + 1))


async def assert_aborted_exactly(
    orch: Orchestrator,
    stages: list[InMemoryStage],
    rid: str,
    out: OrchOutput,
    reason: str,
    submitted: list[int],
    finished: set[int],
) -> None:
    """The one final error output, the state gone, every live holder aborted once,
    later outputs dropped and counted, and nothing else arrives."""
    assert out.request_id == rid
    assert out.error == reason and out.finished and out.data is None
    assert orch.request_states == {}
    live_holders = [sid for sid in submitted if sid not in finished]
    await wait_for(lambda: all(rid in stages[sid].aborted for sid in live_holders))
    for sid, stage in enumerate(stages):
        assert stage.submitted_ids().count(rid) == (1 if sid in submitted else 0), sid
        assert stage.aborted.count(rid) == (1 if sid in live_holders else 0), sid
    before = orch.dropped_outputs
    for sid in submitted:
        stages[sid].emit(StageOutput(rid, "late", True))
    await wait_for(lambda: orch.dropped_outputs == before + len(submitted))
    assert orch.request_states == {}
    await assert_no_output(orch)
    for sid, stage in enumerate(stages):  # still exactly once
        assert stage.aborted.count(rid) == (1 if sid in live_holders else 0), sid


# --- abort at every point of a request's life ----------------------------------


async def test_abort_right_after_add_before_the_handler_ran(orch_cls: type[Orchestrator]) -> None:
    stages = hand_driven()
    async with orch_cls(stages, FINALS, identity_forward) as orch:
        await orch.add_request("r1", "p")
        await orch.abort_request("r1")
        assert "r1" not in orch.request_states  # the handler had not run yet
        out = await orch.next_output(timeout=5)
        await assert_aborted_exactly(
            orch, stages, "r1", out, "aborted", expected_submitted(orch, 0), set()
        )


async def test_abort_while_stage0_is_running(orch_cls: type[Orchestrator]) -> None:
    stages = hand_driven()
    async with orch_cls(stages, FINALS, identity_forward) as orch:
        await orch.add_request("r1", "p")
        await wait_for(lambda: "r1" in stages[0].submitted_ids())
        stages[0].emit(StageOutput("r1", "c0", False))
        stages[0].emit(StageOutput("r1", "c1", False))
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 0, "c0", False)
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 0, "c1", False)
        await orch.abort_request("r1", "user cancelled")
        out = await orch.next_output(timeout=5)
        await assert_aborted_exactly(
            orch, stages, "r1", out, "user cancelled", expected_submitted(orch, 0), set()
        )


async def test_abort_after_stage0_finished_before_stage1_output(
    orch_cls: type[Orchestrator],
) -> None:
    """Sequential: stage 1 was forwarded to and has emitted nothing yet. Streaming: the
    same moment, stages 1 and 2 still hold the request."""
    stages = hand_driven()
    async with orch_cls(stages, FINALS, identity_forward) as orch:
        await orch.add_request("r1", "p")
        await wait_for(lambda: "r1" in stages[0].submitted_ids())
        stages[0].emit(StageOutput("r1", "last", True))
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 0, "last", False)
        await wait_for(lambda: "r1" in stages[1].submitted_ids())
        if orch_cls is Orchestrator:
            assert stages[1].submitted == [("r1", ["last"])]
        await orch.abort_request("r1")
        out = await orch.next_output(timeout=5)
        await assert_aborted_exactly(
            orch, stages, "r1", out, "aborted", expected_submitted(orch, 1), {0}
        )


async def test_abort_after_the_request_ended_changes_nothing(
    orch_cls: type[Orchestrator],
) -> None:
    stages = hand_driven()
    async with orch_cls(stages, FINALS, identity_forward) as orch:
        await orch.add_request("r1", "p")
        for sid in (0, 1, 2):
            await wait_submitted(stages[sid], "r1")
            stages[sid].emit(StageOutput("r1", f"end{sid}", True))
            if sid in FINALS:
                out = await orch.next_output(timeout=5)
                assert out == OrchOutput("r1", sid, f"end{sid}", sid == 2)
        assert orch.request_states == {}
        await orch.abort_request("r1")
        await handler_barrier(orch, stages[0], "after")
        await assert_no_output(orch)
        assert all(stage.aborted == [] for stage in stages)
        assert orch.dropped_outputs == 0
        assert orch.request_states.keys() == {"after"}


async def test_abort_of_a_never_added_request_changes_nothing(
    orch_cls: type[Orchestrator],
) -> None:
    stages = hand_driven()
    async with orch_cls(stages, FINALS, identity_forward) as orch:
        await orch.abort_request("nobody")
        await handler_barrier(orch, stages[0], "after")
        await assert_no_output(orch)
        assert all(stage.aborted == [] for stage in stages)
        assert orch.request_states.keys() == {"after"}


# --- abort racing the natural end -----------------------------------------------


def finish_at_once(_rid: str, _data: Any) -> list[tuple[Any, bool]]:
    return [("s0", True)]


async def test_abort_racing_the_natural_end_yields_exactly_one_final_output(
    orch_cls: type[Orchestrator],
) -> None:
    """Stage 0 finishes inside submit; stage 1 (the final stage) is driven by hand: its last
    output and the abort are issued back to back, in both orders, with 0-3 yields between."""
    stages = [InMemoryStage(finish_at_once), InMemoryStage()]
    n = 400
    rids = [f"r{i}" for i in range(n)]
    async with orch_cls(stages, {1}, identity_forward) as orch:
        for rid in rids:
            await orch.add_request(rid, "p")
        await wait_for(lambda: set(stages[1].submitted_ids()) == set(rids))
        await wait_for(lambda: all(orch.request_states[r].finished == {0} for r in rids))
        for i, rid in enumerate(rids):
            yields = (i // 2) % 4
            if i % 2 == 0:
                stages[1].emit(StageOutput(rid, "end", True))
                for _ in range(yields):
                    await asyncio.sleep(0)
                await orch.abort_request(rid)
            else:
                await orch.abort_request(rid)
                for _ in range(yields):
                    await asyncio.sleep(0)
                stages[1].emit(StageOutput(rid, "end", True))
        outs: list[OrchOutput] = []
        while sum(o.finished for o in outs) < n:
            outs.append(await orch.next_output(timeout=10))
        errors = {o.request_id for o in outs if o.error is not None}
        # every abort was handled, every "end" was dispatched: nothing more can come
        await handler_barrier(orch, stages[0], "barrier")
        await wait_for(lambda: orch.dropped_outputs == len(errors))
        await assert_no_output(orch)
        finished_per_request = {rid: 0 for rid in rids}
        for o in outs:
            finished_per_request[o.request_id] += o.finished
        assert finished_per_request == dict.fromkeys(rids, 1)
        assert len(outs) == n  # stage 1 emits one output per request: no extra ones either
        for o in outs:
            if o.request_id in errors:
                assert o.error == "aborted" and o.data is None
            else:
                assert (o.stage_id, o.data, o.error) == (1, "end", None)
        assert sorted(stages[1].aborted) == sorted(errors)  # each aborted at most once
        assert stages[0].aborted == []  # it had finished every request
        assert orch.request_states.keys() == {"barrier"}
        # both outcomes of the race were exercised
        assert 0 < len(errors) < n, len(errors)


# --- deadlines ----------------------------------------------------------------------


async def test_deadline_ends_a_request_that_never_finishes(orch_cls: type[Orchestrator]) -> None:
    stages = hand_driven()
    loop = asyncio.get_running_loop()
    async with orch_cls(stages, FINALS, identity_forward) as orch:
        t0 = loop.time()
        await orch.add_request("r1", "p", deadline_s=0.05)
        await wait_for(lambda: "r1" in stages[0].submitted_ids())
        stages[0].emit(StageOutput("r1", "c0", False))
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 0, "c0", False)
        out = await orch.next_output(timeout=5)
        assert loop.time() - t0 >= 0.05  # not before its time
        await assert_aborted_exactly(
            orch, stages, "r1", out, "deadline exceeded", expected_submitted(orch, 0), set()
        )


async def test_default_deadline_applies_without_a_per_request_value(
    orch_cls: type[Orchestrator],
) -> None:
    stages = hand_driven()
    async with orch_cls(stages, FINALS, identity_forward, default_deadline_s=0.05) as orch:
        await orch.add_request("r1", "p")
        await orch.add_request("long", "p", deadline_s=30)  # a per-request value wins
        out = await orch.next_output(timeout=5)
        assert out.request_id == "r1" and out.error == "deadline exceeded"
        assert out.finished and out.data is None
        assert orch.request_states.keys() == {"long"}
        expected = expected_submitted(orch, 0)
        await wait_for(lambda: all("r1" in stages[sid].aborted for sid in expected))
        assert all("long" not in stage.aborted for stage in stages)
        for sid in (0, 1, 2):  # "long" still runs normally
            await wait_submitted(stages[sid], "long")
            stages[sid].emit(StageOutput("long", f"end{sid}", True))
        outs = [await orch.next_output(timeout=5), await orch.next_output(timeout=5)]
        assert outs == [OrchOutput("long", 0, "end0", False), OrchOutput("long", 2, "end2", True)]
        assert orch.request_states == {}
        await assert_no_output(orch)


async def test_request_finishing_before_its_deadline_gets_no_error_later(
    orch_cls: type[Orchestrator],
) -> None:
    """A witness request with a later deadline that never finishes: once its deadline error
    arrived, the earlier deadline of the finished request has passed and was handled."""
    stages = hand_driven()
    loop = asyncio.get_running_loop()
    async with orch_cls(stages, FINALS, identity_forward) as orch:
        t0 = loop.time()
        await orch.add_request("fast", "p", deadline_s=0.5)
        await orch.add_request("witness", "p", deadline_s=0.6)
        for sid in (0, 1, 2):
            await wait_submitted(stages[sid], "fast")
            stages[sid].emit(StageOutput("fast", f"end{sid}", True))
        outs = [await orch.next_output(timeout=5), await orch.next_output(timeout=5)]
        assert outs == [OrchOutput("fast", 0, "end0", False), OrchOutput("fast", 2, "end2", True)]
        assert loop.time() - t0 < 0.5, "finished too late for this test to mean anything"
        witness = await orch.next_output(timeout=5)
        assert witness.request_id == "witness" and witness.error == "deadline exceeded"
        assert loop.time() - t0 >= 0.6
        await assert_no_output(orch, timeout=0.1)
        assert all("fast" not in stage.aborted for stage in stages)
        assert orch.request_states == {}


async def test_shutdown_with_pending_deadlines_leaves_no_pending_task(
    orch_cls: type[Orchestrator],
) -> None:
    """Warnings are errors: a destroyed pending task would fail the run."""
    stages = hand_driven()
    orch = orch_cls(stages, FINALS, identity_forward, default_deadline_s=30)
    await orch.start()
    await orch.add_request("r1", "p")
    await orch.add_request("r2", "p", deadline_s=60)
    await wait_for(lambda: orch.request_states.keys() == {"r1", "r2"})
    await orch.shutdown()
    assert all(t.done() for t in asyncio.all_tasks() if t is not asyncio.current_task())
    assert all(stage.aborted == [] for stage in stages)
    assert orch.request_states.keys() == {"r1", "r2"}


async def test_deadlines_of_ended_requests_are_not_retained() -> None:
    """The deadline heap follows live requests: ended ones are dropped from it, in bulk."""
    stages = [InMemoryStage(lambda rid, data: [(data, True)])]
    async with Orchestrator(stages, {0}, default_deadline_s=600) as orch:
        for i in range(1000):
            await orch.add_request(f"r{i}", "x")
            assert (await orch.next_output(timeout=5)).finished
        assert orch.request_states == {}
        assert len(orch._deadlines) <= 2 * 64 + 2
