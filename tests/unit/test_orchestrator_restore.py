"""The core's hooks for a durable shell: restoring a request routed before, the output
sink, and the change hook (SPEC §3 routing unchanged)."""

from __future__ import annotations

import pytest

from omni_runtime import Orchestrator, OrchOutput, StageOutput
from omni_runtime.core.in_memory import InMemoryStage
from omni_runtime.core.loops import Hooks
from omni_runtime.core.orchestrator import StreamingOrchestrator
from omni_runtime.core.types import ReqState
from tests.fakes import identity_forward, prefix_wav
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(30)


async def test_a_restored_request_resumes_where_it_was_and_submits_nothing_again() -> None:
    stages = [InMemoryStage(), InMemoryStage(), InMemoryStage(prefix_wav)]
    async with Orchestrator(stages, {0, 2}, identity_forward) as orch:
        state = ReqState(prompt="hi there", submitted={0, 1}, finished={0})
        assert orch.restore_request("r1", state, deadline_s=30)
        assert not orch.restore_request("r1", ReqState(prompt="x"), None)  # live already
        stages[1].emit(StageOutput("r1", ["HI", "THERE"], True))
        outs = [await orch.next_output(timeout=10) for _ in range(2)]
        assert outs == [
            OrchOutput("r1", 2, "wav:HI", False),
            OrchOutput("r1", 2, "wav:THERE", True),
        ]
        assert stages[0].submitted == [] and stages[1].submitted == []
        assert stages[2].submitted == [("r1", [["HI", "THERE"]])]
        assert orch.request_states == {} and orch.dropped_outputs == 0


async def test_a_restored_request_past_its_deadline_ends_with_one_error() -> None:
    stages = [InMemoryStage(), InMemoryStage()]
    async with StreamingOrchestrator(stages, {1}, identity_forward) as orch:
        orch.restore_request("r1", ReqState(prompt="p", submitted={0, 1}), deadline_s=-1.0)
        out = await orch.next_output(timeout=10)
        assert out == OrchOutput("r1", 1, None, True, error="deadline exceeded")
        assert orch.request_states == {}


async def test_the_sink_and_the_change_hook_see_every_output_and_state_change() -> None:
    stages = [InMemoryStage(), InMemoryStage()]
    seen: list[OrchOutput] = []
    changes: list[tuple[str, bool, frozenset[int]]] = []

    def changed(rid: str, state: ReqState | None) -> None:
        changes.append(
            (rid, state is not None, frozenset(state.finished) if state else frozenset())
        )

    orch = Orchestrator(stages, {0, 1}, identity_forward, hooks=Hooks(seen.append, changed))
    async with orch:
        await orch.add_request("r1", "p")
        await wait_for(lambda: bool(stages[0].submitted))
        stages[0].emit(StageOutput("r1", "a", True))
        await wait_for(lambda: bool(stages[1].submitted))
        stages[1].emit(StageOutput("r1", "b", True))
        await wait_for(lambda: len(seen) >= 2)
    assert seen == [OrchOutput("r1", 0, "a", False), OrchOutput("r1", 1, "b", True)]
    assert changes == [
        ("r1", True, frozenset()),  # registered
        ("r1", True, frozenset({0})),  # stage 0 finished (then stage 1 submitted)
        ("r1", True, frozenset({0, 1})),  # stage 1 finished
        ("r1", False, frozenset()),  # ended
    ]
    with pytest.raises(TimeoutError):
        await orch.next_output(timeout=0.01)  # nothing went to the queue


async def test_step_done_is_heard_once_a_burst_of_outputs_is_all_handled() -> None:
    """A shell sends what a step queued when it hears `step_done`: once per burst, so the
    outputs read together leave together (one per output would hold the rest back)."""
    stages = [InMemoryStage()]
    seen: list[OrchOutput] = []
    heard: list[int] = []
    hooks = Hooks(seen.append, step_done=lambda: heard.append(len(seen)))
    orch = Orchestrator(stages, {0}, identity_forward, hooks=hooks)
    async with orch:
        await orch.add_request("r1", "p")
        await wait_for(lambda: bool(stages[0].submitted))
        assert heard == [0]  # the add, on its own
        for i, word in enumerate(["a", "b", "c"]):  # read together, in one batch
            stages[0].emit(StageOutput("r1", word, i == 2))
        await wait_for(lambda: len(seen) == 3)
        await wait_for(lambda: len(heard) == 2)
    assert heard == [0, 3]
