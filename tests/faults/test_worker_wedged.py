"""One of two replicas of a stage wedged under load: its step engine's `step()` never
returns, so its scheduler loop stops while its heartbeat thread goes on beating (no other
replica would ever claim its inputs). Its watchdog notices within `OMNI_WATCHDOG_S`, logs
where the loop is stuck, deletes its heartbeat and exits non-zero; the other replica
claims its inputs and finishes them: nothing lost, no final twice."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from omni_runtime.watchdog import WEDGED_EXIT_CODE, Watchdog
from tests.faults.harness import FaultDeployment, header, run_load
from tests.faults.wedging import WEDGE_AFTER_STEPS
from tests.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]

WATCHDOG_S = 2.0
NOTICED = re.compile(r"stage 1's scheduler loop made no progress for ([\d.]+) s with work")


def echo_upper(prompt: str) -> list[tuple[int, Any, bool]]:
    return [(1, [w.upper() for w in prompt.split()], True)]


async def test_a_wedged_worker_loop_stops_its_process_and_loses_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = 200, 40
    stage = {"entry": "tests.faults.wedging:WedgingEngine", "options": {}}
    with FaultDeployment(
        redis_url, tmp_path, "seed.yaml", final_stage_ids=[1], stages={1: stage}
    ) as d:
        cmd = [sys.executable, "-m", "omni_runtime.cli", "worker", "--pipeline", str(d.path)]
        wedging = {WEDGE_AFTER_STEPS: "5", "OMNI_WATCHDOG_S": str(WATCHDOG_S)}
        d.group._spawn("wedging", [*cmd, "--mode", d.pipeline.mode, "--stage", "1"], wedging)
        beating = await d.wait_worker_status(1, lambda docs: len(docs) == 2, timeout_s=60)
        assert len(beating) == 2, beating
        wedged = d.pid("wedging")

        prompts = {f"v{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(d, "worker scheduler loop wedged", prompts, echo_upper, concurrency)
        await wait_for(lambda: d.exit_code(wedged) is not None, deadline_s=30)
        exit_code = d.exit_code(wedged)
        log = d.group.tail("wedging", 60)
    noticed = NOTICED.search(log)
    print(f"\n--- the wedged worker's log\n{log}\n---")
    print("\n" + header() + "\n" + report.line() + f"  noticed_after={noticed and noticed[1]}s")
    assert (report.ok, report.lost, report.wrong, report.duplicated) == (n, 0, 0, 0), report
    assert exit_code == WEDGED_EXIT_CODE, log
    assert noticed is not None, log
    period_s = Watchdog(WATCHDOG_S).period_s
    assert WATCHDOG_S <= float(noticed[1]) <= WATCHDOG_S + 5 * period_s, log  # logged to 0.1 s
    assert "threading.Event().wait()  # the fault" in log, "the log shows where it is stuck"
