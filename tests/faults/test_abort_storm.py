"""An abort storm in streaming mode: half the requests aborted at random moments of their
life. Each request ends once (its result, or `aborted`); nothing is lost or repeated; no
worker holds state for them and no chunk key or stream entry is left behind."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2
from tests.faults.orchestrators import wait_for_slots
from tests.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]


async def test_an_abort_storm_ends_every_request_once_and_leaves_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = (2000, 200) if FULL else (300, 50)
    rng = random.Random(7)
    prompts = {f"a{i}": " ".join(f"w{i}x{k}" for k in range(rng.randint(2, 12))) for i in range(n)}
    abort_after_s = {rid: rng.random() * 0.06 for rid in prompts if rng.random() < 0.5}
    with FaultDeployment(
        redis_url,
        tmp_path,
        "seed.yaml",
        mode="streaming",
        final_stage_ids=[2],
        stages={1: {"options": {"delay_ms": 20}}},
    ) as d:
        report = await run_load(
            d,
            "abort storm (streaming)",
            prompts,
            seed_final_2,
            concurrency,
            abort_after_s=abort_after_s,
        )

        def settled() -> bool:
            docs = [doc for sid in range(3) for doc in d.worker_status(sid)]
            return len(docs) == 3 and all(doc["in_flight"] == 0 for doc in docs)

        await wait_for(settled, deadline_s=30)  # no worker holds state for any of them
        control = d.settings.names.control  # a broadcast log, trimmed by age (MINID)

        def left() -> list[str]:
            return [key for key in d.leftover_keys() if key != control]

        try:
            await wait_for(lambda: not left(), deadline_s=30)  # chunks swept, entries gone
        except AssertionError:
            raise AssertionError(f"left behind: {left()[:10]}") from None
        report.leftover_keys = len(left())
        report.memory_after = d.used_memory()
        d.group.check_alive()
    print("\n" + header() + "\n" + report.line())
    assert (report.lost, report.wrong, report.duplicated) == (0, 0, 0), report
    assert report.ok + report.failed == n and report.errors.keys() <= {"aborted"}, report
    assert report.failed > n // 4, report  # the storm did abort requests mid-flight
    assert report.ok >= n - len(abort_after_s), report  # every request not aborted is exact


async def test_with_two_orchestrators_every_abort_reaches_the_slot_that_holds_its_request(
    redis_url: str, tmp_path: Path
) -> None:
    """The slots share the requests stream's entries out: a request and its abort each go to
    either. Every request here is aborted while its stage 1 still works on it (1 s), so each
    must end `aborted`: an abort that reached the other slot and went no further would let
    its request run to its end."""
    n, concurrency = (600, 150) if FULL else (120, 40)
    rng = random.Random(11)
    prompts = {f"b{i}": f"w{i} x{i} y{i}" for i in range(n)}
    abort_after_s = {rid: 0.05 + rng.random() * 0.15 for rid in prompts}
    with FaultDeployment(
        redis_url,
        tmp_path,
        "seed.yaml",
        orchestrators=2,
        mode="streaming",
        final_stage_ids=[2],
        stages={1: {"options": {"delay_ms": 1000}}},
    ) as d:
        await wait_for_slots(d.redis, d.settings.names, 2)
        report = await run_load(
            d,
            "aborts (two orchestrators)",
            prompts,
            seed_final_2,
            concurrency,
            abort_after_s=abort_after_s,
        )
        d.group.check_alive()
    print("\n" + header() + "\n" + report.line())
    assert (report.lost, report.wrong, report.duplicated) == (0, 0, 0), report
    assert report.failed == n and report.errors.keys() == {"aborted"}, report
