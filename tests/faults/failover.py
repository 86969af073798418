"""What the Redis failover scenarios (Sentinel, Cluster) share: settings and promises.

Every request ends with exactly one final: exact, or (the few in flight at the kill whose
last writes the replica never got) one error saying so; none hangs past its deadline and
its grace; no partial success; new work is served again within the failover plus 2 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from omni_runtime.redis_io.client_deadlines import DEADLINE_EXCEEDED
from omni_runtime.wire.messages import REDIS_LOST_STATE
from tests.faults.harness import FaultDeployment, FaultReport, header, run_load, seed_final_2

N, CONCURRENCY = 1000, 100
DEADLINE_S = 15.0
RETRY_MAX_S = 0.5
"""The runtime's longest wait between retries: the service is back within this of the
failover (the default, 2 s, would take up the whole of the target's slack)."""
RETRY_ATTEMPTS = 60
"""A write's retries must outlast the failover: 20 (the default) at 0.5 s apart gave up
after ~10 s, within a Cluster failover on a loaded machine (7-9 s and more)."""
RESUME_SLACK_S = 2.0
ENV = {
    "OMNI_DEADLINE_S": str(DEADLINE_S),
    "OMNI_RETRY_MAX_S": str(RETRY_MAX_S),
    "OMNI_RETRY_ATTEMPTS": str(RETRY_ATTEMPTS),
}
SETTINGS = {"deadline_s": DEADLINE_S, "retry_max_s": RETRY_MAX_S, "retry_attempts": RETRY_ATTEMPTS}
LOSS_ERRORS = {REDIS_LOST_STATE, "outputs lost", DEADLINE_EXCEEDED}
"""What a request whose writes died with the old primary may end with: the orchestrator
saw its state gone, the client saw a gap in its sequence numbers, or nobody had it and its
deadline passed. Never a success with a piece missing."""


def check_failover(report: FaultReport, failover_s: float, logs: dict[str, str]) -> None:
    """Print the scenario's row, then hold it to the promises above (a failure shows each
    process's last log lines with it)."""
    print(
        "\n" + header() + "\n" + report.line() + f"  failover_s={failover_s:.2f} "
        f"resumed_s={report.resumed_s} errors={report.errors}"
    )
    for name, tail in logs.items():  # shown with a failure (pytest keeps what passes quiet)
        print(f"--- {name} ---\n{tail}")
    assert (report.wrong, report.lost) == (0, 0), report
    assert report.ok + report.failed == report.requests, report
    assert set(report.errors) <= LOSS_ERRORS, report.error_texts
    assert report.failed <= CONCURRENCY, report  # only requests in flight at the kill
    assert not any(report.late_successes.values()), report  # no error final, then a success
    assert report.resumed_s is not None, report
    assert report.resumed_s <= failover_s + RESUME_SLACK_S, report


async def fail_over_under_load(
    url: str, tmp_path: Path, scenario: str, kill_and_wait: Callable[[], None]
) -> None:
    """The seed pipeline on `url` under the load above; `kill_and_wait` (run on a thread)
    kills the primary and returns once another has taken over; then the promises."""
    failover_s: list[float] = []
    with FaultDeployment(
        url, tmp_path, "seed.yaml", env=ENV, final_stage_ids=[2],
        stages={1: {"options": {"delay_ms": 5}}},
    ) as d:  # fmt: skip
        d.settings = d.settings.model_copy(update=SETTINGS)

        async def kill_primary() -> None:
            killed = time.monotonic()
            await asyncio.to_thread(kill_and_wait)
            failover_s.append(time.monotonic() - killed)

        prompts = {f"r{i}": f"a{i} b{i}" for i in range(N)}
        report = await run_load(
            d, scenario, prompts, seed_final_2, CONCURRENCY, N // 4, kill_primary, timeout_s=30
        )
        logs = {name: d.group.tail(name, 40) for name, _proc, _f in d.group.procs}
    check_failover(report, failover_s[0], logs)
