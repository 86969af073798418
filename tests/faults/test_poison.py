"""Poison inputs: a step engine that raises fails the requests it concerns, and only those;
every replica stays up and nothing is left pending."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import FULL, FaultDeployment, header, run_load

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]


def echo_upper(prompt: str) -> list[tuple[int, Any, bool]]:
    return [(1, [w.upper() for w in prompt.split()], True)]


def poison_pipeline(always: bool) -> dict[str, Any]:
    return {
        "final_stage_ids": [1],
        "stages": {
            1: {
                "entry": "tests.faults.poison:PoisonEngine",
                "replicas": 2,
                "options": {"always": always},
            }
        },
    }


def pending_inputs(d: FaultDeployment) -> int:
    total = 0
    for sid in (0, 1):
        for group in d.redis.xinfo_groups(d.settings.names.stage_in(sid)):
            total += int(group["pending"])
    return total


async def test_only_poisoned_requests_fail_and_every_replica_lives(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = (2000, 200) if FULL else (200, 40)
    with FaultDeployment(redis_url, tmp_path, "seed.yaml", **poison_pipeline(False)) as d:
        prompts = {f"p{i}": ("poison pill" if i % 10 == 0 else f"good {i}") for i in range(n)}
        report = await run_load(d, "poison on some inputs", prompts, echo_upper, concurrency)
        d.group.check_alive()  # raises, naming the dead process, if a replica died
        assert pending_inputs(d) == 0
    print("\n" + header() + "\n" + report.line())
    poisoned = n // 10
    assert (report.ok, report.failed, report.lost, report.wrong) == (n - poisoned, poisoned, 0, 0)
    assert report.duplicated == 0


async def test_an_engine_that_always_raises_fails_every_request_once(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = (500, 100) if FULL else (60, 20)
    with FaultDeployment(redis_url, tmp_path, "seed.yaml", **poison_pipeline(True)) as d:
        prompts = {f"a{i}": f"word {i}" for i in range(n)}
        report = await run_load(d, "poison on every input", prompts, echo_upper, concurrency)
        d.group.check_alive()
        assert pending_inputs(d) == 0
    print("\n" + header() + "\n" + report.line())
    assert (report.failed, report.lost, report.duplicated) == (n, 0, 0), report
