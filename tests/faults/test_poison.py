"""Poison inputs: a step engine that raises fails the requests it concerns, and only those;
every replica stays up and nothing is left pending. An engine that cannot name them (a
plain exception) is started over and the poison found by the worker: the others' outputs
reach the client once each, in order."""

from __future__ import annotations

import re
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


def echo_words(prompt: str) -> list[tuple[int, Any, bool]]:
    words = prompt.split()
    return [(1, w.upper(), i == len(words) - 1) for i, w in enumerate(words)]


async def test_a_plain_exception_from_step_fails_only_the_poison_and_repeats_no_chunk(
    redis_url: str, tmp_path: Path
) -> None:
    """2 replicas; 1 request in 10 makes every step it is in raise a plain RuntimeError. The
    good ones stream 8 words, one per (paced) step, so a reset finds them mid-stream."""
    n, concurrency = (1000, 100) if FULL else (100, 20)
    stage = {"entry": "tests.faults.poison:BatchPoisonEngine", "replicas": 2}
    changes: dict[str, Any] = {
        "final_stage_ids": [1],
        "stages": {1: stage | {"options": {"step_ms": 2}}},
    }
    with FaultDeployment(redis_url, tmp_path, "seed.yaml", **changes) as d:
        prompts = {
            f"b{i}": f"poison {i}" if i % 10 == 5 else " ".join(f"w{i}.{k}" for k in range(8))
            for i in range(n)
        }
        report = await run_load(
            d, "step() raises: 1 in 10 inputs", prompts, echo_words, concurrency
        )
        d.group.check_alive()
        poisoned = n // 10

        def counted(docs: list[dict[str, Any]]) -> bool:
            return len(docs) == 2 and sum(doc.get("poisoned", 0) for doc in docs) >= poisoned

        docs = await d.wait_worker_status(1, counted, timeout_s=10)
        assert pending_inputs(d) == 0
    resets = sum(doc["engine_resets"] for doc in docs)
    print(f"\n{header()}\n{report.line()}\nfailed steps (engine resets): {resets} for {poisoned} "
          f"poison requests, {resets / poisoned:.1f} each; per replica {[d['engine_resets'] for d in docs]}")  # fmt: skip
    assert (report.ok, report.failed, report.lost, report.wrong) == (n - poisoned, poisoned, 0, 0)
    assert report.duplicated == 0
    assert report.errors == {"stage 1 failed": poisoned}, report.errors
    error = report.error_texts["stage 1 failed"]
    named = r"upper_all step\(\) raised RuntimeError: poisoned input in a batch of \d+ \(poison: "
    assert re.search(named + r"this request was in \d+ failed steps\)$", error), error
    assert sum(doc["poisoned"] for doc in docs) == poisoned
