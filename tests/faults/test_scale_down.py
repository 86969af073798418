"""Scale-down under load, as a Kubernetes rollout or an autoscaler does it: SIGTERM to two of
three stage-1 replicas and to one of two orchestrators at once. The replicas finish what they
hold (or hand it back) and exit 0 within the drain; the orchestrator gives its slot up and the
other takes it over at once (a released-slot notice, not the next lease round). Every request
ends exact, once; no request waits much longer for its next output than the load itself
makes it wait."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2
from tests.faults.orchestrators import wait_for_slots

pytestmark = [pytest.mark.solo, pytest.mark.timeout(300), pytest.mark.redis_server]

DRAIN_S = 5.0
STALL_LIMIT_S = 0.5
"""The issue's target for the worst wait of a request at the drain (0.52-1.0 s before the
notice, when the surviving orchestrator looked for a free slot every lease TTL / 4)."""


async def test_sigterm_of_replicas_and_an_orchestrator_under_load_is_seamless(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = (2000, 200) if FULL else (400, 80)
    exits: dict[str, tuple[int | None, float]] = {}
    with FaultDeployment(
        redis_url,
        tmp_path,
        "seed.yaml",
        orchestrators=2,
        env={"OMNI_DRAIN_S": str(DRAIN_S)},  # the default lease TTL: no help from a short one
        final_stage_ids=[2],
        stages={
            0: {"replicas": 3},
            1: {"replicas": 3, "options": {"delay_ms": 5}},
            2: {"replicas": 3},
        },
    ) as d:
        await wait_for_slots(d.redis, d.settings.names, 2)
        procs = {name: proc for name, proc, _f in d.group.procs}
        victims = ["stage1-upper_all-0", "stage1-upper_all-1", "orchestrator"]

        async def scale_down() -> None:
            sent = time.monotonic()
            for name in victims:
                procs[name].send_signal(signal.SIGTERM)
            deadline = sent + DRAIN_S + 5
            while any(procs[v].poll() is None for v in victims) and time.monotonic() < deadline:
                for v in victims:
                    if v not in exits and procs[v].poll() is not None:
                        exits[v] = (procs[v].poll(), time.monotonic() - sent)
                await asyncio.sleep(0.005)  # polling exit codes: a wait with a deadline
            for v in victims:
                exits.setdefault(v, (procs[v].poll(), time.monotonic() - sent))

        prompts = {f"s{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d, "scale-down (SIGTERM)", prompts, seed_final_2, concurrency, n // 3, scale_down
        )
    print("\n" + header() + "\n" + report.line())
    print(
        f"worst wait before the drain {report.stall_before_s:.3f} s, after "
        f"{report.stall_after_s:.3f} s; exits (code, s after SIGTERM): {exits}"
    )
    assert (report.ok, report.lost, report.wrong, report.duplicated) == (n, 0, 0, 0), report
    assert all(code == 0 and took <= DRAIN_S for code, took in exits.values()), exits
    # The target, unless the load alone (before the drain) already waited longer on this host.
    assert report.stall_after_s <= max(STALL_LIMIT_S, 1.5 * report.stall_before_s), report
