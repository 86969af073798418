"""SPEC §1/§3, streaming ("async chunk") mode: one test per rule of StreamingOrchestrator."""

from __future__ import annotations

from typing import Any

import pytest

from omni_runtime import Orchestrator, OrchOutput, StageOutput
from omni_runtime.core.in_memory import Behaviour, InMemoryStage
from omni_runtime.core.orchestrator import StreamingOrchestrator
from omni_runtime.core.types import StageFailure
from tests.fakes import identity_forward, seed_stages, split_words
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(30)


class LoggedStage(InMemoryStage):
    """An InMemoryStage that also notes, in a log shared by all stages, the order of submits."""

    def __init__(
        self,
        stage_id: int,
        log: list[tuple[int, str]] | None = None,
        behaviour: Behaviour | None = None,
        fail_on: set[str] | None = None,
    ) -> None:
        super().__init__(behaviour, fail_on)
        self.stage_id = stage_id
        self.log = log if log is not None else []

    async def submit(
        self, request_id: str, data: Any, params: dict[str, Any] | None = None
    ) -> None:
        await super().submit(request_id, data)
        self.log.append((self.stage_id, request_id))


def make_stages(n: int) -> tuple[list[LoggedStage], list[tuple[int, str]]]:
    log: list[tuple[int, str]] = []
    return [LoggedStage(sid, log) for sid in range(n)], log


async def dispatched_barrier(orch: Orchestrator, stage: InMemoryStage) -> None:
    """Everything `stage` emitted so far has been handled: its reader/dispatcher FIFO keeps
    order, so once an output for a never-added request is counted as dropped, all before it
    were handled too."""
    before = orch.dropped_outputs
    stage.emit(StageOutput("barrier-never-added", None, True))
    await wait_for(lambda: orch.dropped_outputs == before + 1)


async def assert_no_output(orch: Orchestrator, timeout: float = 0.05) -> None:
    with pytest.raises(TimeoutError):
        await orch.next_output(timeout=timeout)


async def collect_until_done(orch: Orchestrator, n_requests: int) -> list[OrchOutput]:
    outs: list[OrchOutput] = []
    done = 0
    while done < n_requests:
        out = await orch.next_output(timeout=10)
        outs.append(out)
        done += out.finished
    return outs


# --- submission ----------------------------------------------------------------


async def test_add_submits_every_stage_up_to_the_last_final_downstream_first() -> None:
    stages, log = make_stages(4)
    async with StreamingOrchestrator(stages, {0, 2}, identity_forward) as orch:
        await orch.add_request("r1", "hello")
        await wait_for(lambda: len(log) == 3)
        assert log == [(2, "r1"), (1, "r1"), (0, "r1")]
        for sid in (0, 1, 2):
            assert stages[sid].submitted == [("r1", "hello")]
        assert stages[3].submitted == []  # beyond the last final stage: never submitted
        assert orch.request_states["r1"].submitted == {0, 1, 2}


async def test_never_forwards_after_a_stage_finishes() -> None:
    stages, _log = make_stages(3)
    async with StreamingOrchestrator(stages, {0, 2}, identity_forward) as orch:
        await orch.add_request("r1", "p")
        await wait_for(lambda: len(stages[0].submitted) == 1)
        stages[0].emit(StageOutput("r1", "a", False))
        stages[0].emit(StageOutput("r1", "b", True))
        stages[1].emit(StageOutput("r1", "B", True))
        await dispatched_barrier(orch, stages[0])
        await dispatched_barrier(orch, stages[1])
        for stage in stages:
            assert stage.submitted == [("r1", "p")]  # only the prompt, nothing forwarded
        assert orch.request_states["r1"].finished == {0, 1}


# --- emission and completion ---------------------------------------------------


async def test_stage0_last_chunk_emitted_unfinished_while_another_final_stage_runs() -> None:
    stages, _log = make_stages(3)
    async with StreamingOrchestrator(stages, {0, 2}, identity_forward) as orch:
        await orch.add_request("r1", "p")
        await wait_for(lambda: len(stages[0].submitted) == 1)
        stages[0].emit(StageOutput("r1", "a", False))
        stages[0].emit(StageOutput("r1", "b", True))
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 0, "a", False)
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 0, "b", False)
        assert "r1" in orch.request_states
        stages[2].emit(StageOutput("r1", "wav", True))
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 2, "wav", True)
        assert orch.request_states == {}
        assert orch.dropped_outputs == 0


@pytest.mark.parametrize("first", [0, 2], ids=["stage0-first", "stage2-first"])
async def test_request_ends_only_when_every_final_stage_finished_in_any_order(first: int) -> None:
    stages, _log = make_stages(3)
    second = 2 if first == 0 else 0
    async with StreamingOrchestrator(stages, {0, 2}, identity_forward) as orch:
        await orch.add_request("r1", "p")
        await wait_for(lambda: len(stages[0].submitted) == 1)
        stages[first].emit(StageOutput("r1", f"end{first}", True))
        assert await orch.next_output(timeout=5) == OrchOutput("r1", first, f"end{first}", False)
        assert orch.request_states["r1"].finished == {first}
        stages[second].emit(StageOutput("r1", f"more{second}", False))
        assert await orch.next_output(timeout=5) == OrchOutput("r1", second, f"more{second}", False)
        assert "r1" in orch.request_states
        stages[second].emit(StageOutput("r1", f"end{second}", True))
        assert await orch.next_output(timeout=5) == OrchOutput("r1", second, f"end{second}", True)
        assert orch.request_states == {}
        await assert_no_output(orch)


async def test_non_final_stage_outputs_never_emitted() -> None:
    stages, _log = make_stages(3)
    async with StreamingOrchestrator(stages, {2}, identity_forward) as orch:
        await orch.add_request("r1", "p")
        await wait_for(lambda: len(stages[0].submitted) == 1)
        stages[0].emit(StageOutput("r1", "t0", False))
        stages[0].emit(StageOutput("r1", "t1", True))
        stages[1].emit(StageOutput("r1", "c0", True))
        await dispatched_barrier(orch, stages[0])
        await dispatched_barrier(orch, stages[1])
        await assert_no_output(orch)
        assert orch.request_states["r1"].stage_data == {0: ["t0", "t1"], 1: ["c0"]}
        stages[2].emit(StageOutput("r1", "wav", True))
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 2, "wav", True)
        assert orch.request_states == {}


# --- dropped outputs -----------------------------------------------------------


def seed_like_stages(orch_cls: type[Orchestrator]) -> list[InMemoryStage]:
    """The seed pipeline; in streaming mode every stage takes the prompt and emits at once."""
    if orch_cls is not StreamingOrchestrator:
        return seed_stages()
    return [
        InMemoryStage(split_words),
        InMemoryStage(lambda _rid, p: [([w.upper() for w in p.split()], True)]),
        InMemoryStage(),  # stage 2 is driven by hand, after stages 0 and 1 were handled
    ]


@pytest.mark.parametrize(
    "orch_cls", [Orchestrator, StreamingOrchestrator], ids=["sequential", "streaming"]
)
async def test_unknown_and_late_outputs_dropped_and_counted_as_base(
    orch_cls: type[Orchestrator],
) -> None:
    """The seed ghost/late example: both modes drop and count exactly the same."""
    stages = seed_like_stages(orch_cls)
    async with orch_cls(stages, {2}, identity_forward) as orch:
        stages[1].emit(StageOutput("ghost", "?", True))
        await orch.add_request("r1", "hi there")
        await wait_for(lambda: len(stages[2].submitted) == 1)
        if orch_cls is StreamingOrchestrator:
            await wait_for(lambda: orch.request_states["r1"].finished == {0, 1})
            stages[2].emit(StageOutput("r1", "wav:HI", False))
            stages[2].emit(StageOutput("r1", "wav:THERE", True))
        outs = await collect_until_done(orch, 1)
        assert [o.data for o in outs] == ["wav:HI", "wav:THERE"]
        stages[2].emit(StageOutput("r1", "wav:LATE", True))
        await wait_for(lambda: orch.dropped_outputs == 2)
        assert orch.request_states == {}
        await dispatched_barrier(orch, stages[0])
        await dispatched_barrier(orch, stages[1])
        assert orch.dropped_outputs == 4  # the ghost, the late one, and the two barriers
        assert orch.request_states == {}
        await assert_no_output(orch)


async def test_late_output_does_not_resurrect_state() -> None:
    stages, _log = make_stages(3)
    async with StreamingOrchestrator(stages, {0}, identity_forward) as orch:
        await orch.add_request("r1", "p")
        await wait_for(lambda: len(stages[0].submitted) == 1)
        stages[0].emit(StageOutput("r1", "x", True))
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 0, "x", True)
        stages[0].emit(StageOutput("r1", "late", False))
        stages[0].emit(StageOutput("never-added", "?", True))
        await wait_for(lambda: orch.dropped_outputs == 2)
        assert orch.request_states == {}
        await assert_no_output(orch)


# --- errors --------------------------------------------------------------------


async def test_failing_submit_ends_only_that_request_with_one_error() -> None:
    stages, _log = make_stages(3)
    stages[1].fail_on = {"bad"}
    async with StreamingOrchestrator(stages, {0, 2}, identity_forward) as orch:
        await orch.add_request("bad", "x")
        await orch.add_request("good", "y")
        bad = await orch.next_output(timeout=5)
        assert bad.request_id == "bad" and bad.finished and bad.data is None
        assert bad.stage_id == 1 and bad.error is not None
        assert "stage 1" in bad.error and "cannot take bad" in bad.error
        assert "bad" not in orch.request_states
        # submits stop at the failure: stage 0 (after stage 1 in downstream-first order)
        # never gets it; stage 2, which already holds it, is told to drop it
        assert "bad" not in stages[0].submitted_ids()
        assert stages[2].submitted_ids()[0] == "bad"
        assert stages[2].aborted == ["bad"]
        await wait_for(lambda: "good" in stages[0].submitted_ids())
        stages[0].emit(StageOutput("good", "Y", True))
        stages[2].emit(StageOutput("good", "wav:Y", True))
        good = [await orch.next_output(timeout=5), await orch.next_output(timeout=5)]
        assert good == [OrchOutput("good", 0, "Y", False), OrchOutput("good", 2, "wav:Y", True)]
        assert orch.request_states == {}
        stages[0].emit(StageOutput("bad", "late", True))
        await wait_for(lambda: orch.dropped_outputs == 1)
        await assert_no_output(orch)


async def test_stage_failure_output_ends_request_and_aborts_stages_still_holding_it() -> None:
    stages, _log = make_stages(3)
    async with StreamingOrchestrator(stages, {0, 2}, identity_forward) as orch:
        await orch.add_request("r1", "p")
        await orch.add_request("other", "q")
        await wait_for(lambda: stages[0].submitted_ids() == ["r1", "other"])
        stages[0].emit(StageOutput("r1", "done", True))
        assert await orch.next_output(timeout=5) == OrchOutput("r1", 0, "done", False)
        stages[1].emit(StageOutput("r1", StageFailure("CUDA out of memory"), True))
        err = await orch.next_output(timeout=5)
        assert err.request_id == "r1" and err.stage_id == 1
        assert err.finished and err.data is None
        assert err.error is not None and "CUDA out of memory" in err.error
        assert orch.request_states.keys() == {"other"}
        await wait_for(lambda: stages[2].aborted == ["r1"])
        assert stages[0].aborted == []  # it had finished the request
        assert stages[1].aborted == []  # it failed the request itself
        stages[2].emit(StageOutput("r1", "wav:late", True))
        await wait_for(lambda: orch.dropped_outputs == 1)
        await assert_no_output(orch)
        stages[0].emit(StageOutput("other", "Q", True))
        stages[2].emit(StageOutput("other", "wav:Q", True))
        outs = await collect_until_done(orch, 1)
        assert [(o.stage_id, o.data, o.error) for o in outs] == [(0, "Q", None), (2, "wav:Q", None)]
        assert orch.request_states == {}
        assert all(stage.aborted in ([], ["r1"]) for stage in stages)
