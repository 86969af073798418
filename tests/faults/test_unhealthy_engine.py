"""An async engine that turns unhealthy under load: its replica leaves service (exits
non-zero, saying why) and the other replica takes its inputs over; every request ends
with exactly one final, nothing lost or repeated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import FULL, FaultDeployment, header, run_load

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]


def spoken(prompt: str) -> list[tuple[int, Any, bool]]:
    """The tiny engine says each word upper-cased, the last one final."""
    words = prompt.split()
    return [(1, w.upper(), i == len(words) - 1) for i, w in enumerate(words)]


async def test_an_unhealthy_engine_takes_its_replica_out_and_loses_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = (2000, 200) if FULL else (300, 50)
    sick = tmp_path / "sick"
    stage = {
        "entry": "tests.engines.tiny_async:TinyAsyncEngine",
        "replicas": 2,
        "options": {"capacity": 8, "token_delay_ms": 20, "sick_file": str(sick)},
    }
    env = {"OMNI_ENGINE_HEALTH_INTERVAL_S": "0.2"}
    with FaultDeployment(
        redis_url, tmp_path, "seed.yaml", env=env, final_stage_ids=[1], stages={1: stage}
    ) as d:

        async def turn_one_engine_unhealthy() -> None:
            sick.touch()  # the first replica whose health check sees it takes it: only one

        prompts = {f"u{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d, "async engine unhealthy", prompts, spoken, concurrency, n // 4,
            turn_one_engine_unhealthy,
        )  # fmt: skip
        replicas = [(name, proc.poll()) for name, proc, _f in d.group.procs if "stage1" in name]
        gone = [(name, code) for name, code in replicas if code is not None]
        survivors = await d.wait_worker_status(  # its takeover shows in its next heartbeat
            1, lambda docs: len(docs) == 1 and docs[0].get("takeovers", 0) > 0, timeout_s=10
        )
        logs = {name: d.group.tail(name, 200) for name, _code in gone}
    print("\n" + header() + "\n" + report.line())
    assert (report.ok, report.failed, report.lost, report.wrong) == (n, 0, 0, 0), report
    assert report.duplicated == 0
    assert len(gone) == 1 and gone[0][1] != 0, replicas
    (log,) = logs.values()
    assert "is dead" in log and "turned unhealthy" in log, log
    # Whichever sees the sick engine first names it: the health check (saying how often it
    # runs), or a request of its own that the engine then refuses with EngineDead.
    assert "OMNI_ENGINE_HEALTH_INTERVAL_S" in log or "raised EngineDead" in log, log
    (survivor,) = survivors
    assert survivor["takeovers"] >= 1, survivor
    assert survivor["engine"]["capacity"] == 8, survivor
