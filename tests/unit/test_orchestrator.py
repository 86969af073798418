"""SPEC §3: the seed examples and one test per routing rule."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from omni_runtime import Orchestrator, OrchOutput, StageOutput
from omni_runtime.core.in_memory import InMemoryStage
from omni_runtime.core.types import asked_finals, request_finals
from omni_runtime.observe.metrics import Metrics
from tests.fakes import identity_forward, seed_stages
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(30)


async def collect_until_done(orch: Orchestrator, n_requests: int) -> list[OrchOutput]:
    outs: list[OrchOutput] = []
    done = 0
    while done < n_requests:
        out = await orch.next_output(timeout=10)
        outs.append(out)
        done += out.finished
    return outs


async def test_seed_finals_0_and_2() -> None:
    stages = seed_stages()
    async with Orchestrator(stages, {0, 2}, identity_forward) as orch:
        await orch.add_request("r1", "hi there")
        outs = await collect_until_done(orch, 1)
        assert outs == [
            OrchOutput("r1", 0, "hi", False),
            OrchOutput("r1", 0, "there", False),
            OrchOutput("r1", 2, "wav:HI", False),
            OrchOutput("r1", 2, "wav:THERE", True),
        ]
        assert stages[1].submitted == [("r1", ["hi", "there"])]
        assert stages[2].submitted == [("r1", [["HI", "THERE"]])]
        assert orch.request_states == {}
        assert orch.dropped_outputs == 0


async def test_seed_final_2_only() -> None:
    async with Orchestrator(seed_stages(), {2}, identity_forward) as orch:
        await orch.add_request("r1", "a b c")
        outs = await collect_until_done(orch, 1)
        assert outs == [
            OrchOutput("r1", 2, "wav:A", False),
            OrchOutput("r1", 2, "wav:B", False),
            OrchOutput("r1", 2, "wav:C", True),
        ]


async def test_seed_ghost_and_late_outputs_dropped_and_counted() -> None:
    stages = seed_stages()
    async with Orchestrator(stages, {2}, identity_forward) as orch:
        stages[1].emit(StageOutput("ghost", "?", True))
        await orch.add_request("r1", "hi there")
        outs = await collect_until_done(orch, 1)
        stages[2].emit(StageOutput("r1", "wav:LATE", True))
        await wait_for(lambda: orch.dropped_outputs == 2)
        assert [o.data for o in outs] == ["wav:HI", "wav:THERE"]
        assert orch.request_states == {}
        with pytest.raises(TimeoutError):
            await orch.next_output(timeout=0.05)


async def test_state_empty_and_nothing_dropped_from_construction() -> None:
    orch = Orchestrator(seed_stages(), {2}, identity_forward)
    assert orch.request_states == {}
    assert orch.dropped_outputs == 0


async def test_final_0_never_submits_stage_1() -> None:
    stages = seed_stages()
    async with Orchestrator(stages, {0}, identity_forward) as orch:
        await orch.add_request("r1", "x y")
        outs = await collect_until_done(orch, 1)
        assert [(o.data, o.finished) for o in outs] == [("x", False), ("y", True)]
        assert stages[1].submitted == [] and stages[2].submitted == []
        assert orch.last_stage == 0


async def test_state_registered_before_first_await_so_outputs_inside_submit_are_kept() -> None:
    """InMemoryStage emits every output inside submit(); none may be dropped."""
    async with Orchestrator(seed_stages(), {0, 2}, identity_forward) as orch:
        for i in range(50):
            await orch.add_request(f"r{i}", "one two three")
        outs = await collect_until_done(orch, 50)
        assert orch.dropped_outputs == 0
        assert len(outs) == 50 * 6


async def test_late_output_does_not_resurrect_state() -> None:
    stages = seed_stages()
    async with Orchestrator(stages, {0}, identity_forward) as orch:
        await orch.add_request("r1", "a")
        await collect_until_done(orch, 1)
        stages[0].emit(StageOutput("r1", "late", False))
        stages[0].emit(StageOutput("never-added", "x", True))
        await wait_for(lambda: orch.dropped_outputs == 2)
        assert "r1" not in orch.request_states
        assert orch.request_states == {}


async def test_per_stage_order_kept_under_interleaved_requests() -> None:
    """Stage 0 is driven by hand, interleaving 100 requests' chunks at random."""
    stage0 = InMemoryStage()
    stages: list[Any] = [stage0, *seed_stages()[1:]]
    n_req, n_chunks = 100, 20
    async with Orchestrator(stages, {0, 2}, identity_forward) as orch:
        for i in range(n_req):
            await orch.add_request(f"r{i}", "")
        await wait_for(lambda: len(stage0.submitted) == n_req)
        cursors = {f"r{i}": 0 for i in range(n_req)}
        rng = random.Random(7)
        while cursors:
            rid = rng.choice(sorted(cursors))
            k = cursors[rid]
            stage0.emit(StageOutput(rid, f"t{k}", k == n_chunks - 1))
            if k == n_chunks - 1:
                del cursors[rid]
            else:
                cursors[rid] = k + 1
            if rng.random() < 0.1:
                await asyncio.sleep(0)
        outs = await collect_until_done(orch, n_req)
        for i in range(n_req):
            rid = f"r{i}"
            s0 = [o.data for o in outs if o.request_id == rid and o.stage_id == 0]
            assert s0 == [f"t{k}" for k in range(n_chunks)]
            s2 = [o.data for o in outs if o.request_id == rid and o.stage_id == 2]
            assert s2 == [f"wav:T{k}" for k in range(n_chunks)]
        assert stages[1].submitted[0][1] == [f"t{k}" for k in range(n_chunks)]
        assert orch.dropped_outputs == 0 and orch.request_states == {}


async def test_stage_error_ends_only_that_request() -> None:
    stages = seed_stages()
    stages[1].fail_on = {"bad"}
    async with Orchestrator(stages, {2}, identity_forward) as orch:
        await orch.add_request("bad", "x")
        await orch.add_request("good", "y")
        outs = await collect_until_done(orch, 2)
        bad = [o for o in outs if o.request_id == "bad"]
        assert len(bad) == 1 and bad[0].finished and bad[0].data is None
        assert bad[0].stage_id == 1 and bad[0].error is not None
        assert "stage 1" in bad[0].error and "cannot take bad" in bad[0].error
        good = [o for o in outs if o.request_id == "good"]
        assert [o.data for o in good] == ["wav:Y"] and good[0].error is None
        assert orch.request_states == {}


async def test_next_output_timeout_raises_timeout_error() -> None:
    async with Orchestrator(seed_stages(), {2}, identity_forward) as orch:
        with pytest.raises(TimeoutError):
            await orch.next_output(timeout=0.01)


async def test_shutdown_leaves_no_pending_task() -> None:
    """Warnings are errors: a destroyed pending task would fail the run."""
    orch = Orchestrator(seed_stages(), {0, 2}, identity_forward)
    await orch.start()
    await orch.add_request("r1", "a b")
    await orch.shutdown()
    assert all(t.done() for t in asyncio.all_tasks() if t is not asyncio.current_task())


async def test_invalid_final_stage_ids_rejected() -> None:
    with pytest.raises(ValueError, match="outside"):
        Orchestrator(seed_stages(), {3}, identity_forward)
    with pytest.raises(ValueError, match="at least one"):
        Orchestrator(seed_stages(), set(), identity_forward)


async def test_duplicate_request_id_rejected_without_touching_the_live_one() -> None:
    stage0 = InMemoryStage()
    async with Orchestrator([stage0], {0}, identity_forward) as orch:
        await orch.add_request("r1", "a")
        await orch.add_request("r1", "b")
        dup = await orch.next_output(timeout=5)
        assert dup.error == "duplicate request id" and dup.finished
        assert stage0.submitted == [("r1", "a")]
        stage0.emit(StageOutput("r1", "A", True))
        assert (await orch.next_output(timeout=5)) == OrchOutput("r1", 0, "A", True)


class PlainStage:
    """Only the SPEC §2 protocol: submit and get_output, nothing managed."""

    def __init__(self) -> None:
        self.inner = InMemoryStage(lambda _rid, data: [(data, True)])

    async def submit(
        self, request_id: str, data: Any, params: dict[str, Any] | None = None
    ) -> None:
        await self.inner.submit(request_id, data)

    async def get_output(self) -> list[StageOutput]:
        return await self.inner.get_output()


async def test_a_plain_stage_needs_no_lifecycle_methods() -> None:
    async with Orchestrator([PlainStage()], {0}, identity_forward) as orch:
        await orch.add_request("r1", "a")
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 0, "a", True)
        await orch.abort_request("r1")  # already ended: nothing to abort anywhere


async def test_managed_stage_hears_every_handled_output_and_every_ended_request() -> None:
    stages = seed_stages()
    async with Orchestrator(stages, {2}, identity_forward) as orch:
        await orch.add_request("r1", "a b")
        await collect_until_done(orch, 1)
        await wait_for(lambda: len(stages[2].handled) == 2)
        assert [o.data for o in stages[0].handled] == ["a", "b"]
        assert all(stage.ended == ["r1"] for stage in stages)
        stages[1].emit(StageOutput("ghost", "?", True))
        await wait_for(lambda: stages[1].ended == ["r1", "ghost"])  # dropped: forgotten too


async def test_second_finished_of_a_stage_is_dropped_and_counted() -> None:
    stage0 = InMemoryStage()
    metrics = Metrics()
    async with Orchestrator([stage0, InMemoryStage()], {0, 1}, metrics=metrics) as orch:
        await orch.add_request("r1", "p")
        await wait_for(lambda: stage0.submitted_ids() == ["r1"])
        stage0.emit(StageOutput("r1", "a", True))
        stage0.emit(StageOutput("r1", "a", True))  # a repeat must not be routed twice
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 0, "a", False)
        await wait_for(lambda: orch.dropped_outputs == 1)
        assert orch.stages[1].submitted == [("r1", ["a"])]  # type: ignore[attr-defined]
        assert orch.request_states["r1"].stage_data[0] == ["a"]
        assert metrics.value("omni_dropped_outputs_total", stage=0) == 1


FINALS = frozenset({0, 1, 3})  # workers/listen.yaml: heard, answered, spoken


@pytest.mark.parametrize(
    ("params", "finals"),
    [
        (None, {0, 1, 3}),
        ({"modalities": ["text", "audio"]}, {0, 1, 3}),
        ({"modalities": ["text"]}, {0, 1}),
        ({"modalities": "text"}, {0, 1, 3}),  # not a list: not the front door's, spoken
        ({"final_stages": [0]}, {0}),
        ({"final_stages": [3], "modalities": ["text"]}, {3}),  # nothing left but the audio
        ({"final_stages": [1, 3], "modalities": ["text"]}, {1}),
        ({"final_stages": [True]}, {0, 1, 3}),  # refused at intake; here, all of them
    ],
)
def test_a_requests_final_stages(params: dict[str, Any] | None, finals: set[int]) -> None:
    assert request_finals(FINALS, 3, params) == finals


def test_final_stages_that_are_not_the_pipelines_are_refused() -> None:
    assert asked_finals(FINALS, None) is None
    assert asked_finals(FINALS, {"final_stages": [0, 1]}) is None
    for bad in ([], [2], [True], ["0"], 0, [0, 0.0]):
        error = asked_finals(FINALS, {"final_stages": bad})
        assert error == f"final_stages must list some of the final stages [0, 1, 3], not {bad!r}"
