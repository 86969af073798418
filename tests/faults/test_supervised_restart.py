"""The only replica of a stage, or the only orchestrator, SIGKILLed under load, with a
supervisor starting it again as an embedded `serve` does (`ProcessGroup.restart_dead`,
every 0.5 s): the process started in its place takes the dead one's inputs (or slots)
over at once (`--replaces`), not once its heartbeat (or leases) expired; nothing lost,
nothing repeated, no request failed (the stage never looked down: the new replica beats
before the dead one's heartbeat expires or is deleted)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from omni_runtime.client.client import OmniClient
from omni_runtime.keys import HEARTBEAT_TTL_S, ORCHESTRATOR_LEASE_TTL_S, WORKERS_GROUP
from omni_runtime.local.stalls import STALL_TTLS
from omni_runtime.worker.takeover import REPLACED_MIN_IDLE_MS
from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2
from tests.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]

TTL_S = min(HEARTBEAT_TTL_S, ORCHESTRATOR_LEASE_TTL_S)
SUPERVISOR_PERIOD_S = 0.5
"""How often `serve` looks for a dead process of its deployment."""


@contextlib.asynccontextmanager
async def supervised(d: FaultDeployment, restarted: list[str]) -> AsyncIterator[None]:
    async def supervise() -> None:
        while True:
            restarted.extend(d.group.restart_dead())
            await asyncio.sleep(SUPERVISOR_PERIOD_S)

    task = asyncio.create_task(supervise())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize(
    ("killed", "started_again"),
    [("stage1", "stage1-upper_all-0"), ("orchestrator", "orchestrator")],
)
async def test_the_only_process_of_its_kind_killed_and_started_again_loses_nothing(
    redis_url: str, tmp_path: Path, killed: str, started_again: str
) -> None:
    n, concurrency = (1000, 100) if FULL else (200, 40)
    with FaultDeployment(
        redis_url,
        tmp_path,
        "seed.yaml",
        final_stage_ids=[2],
        stages={1: {"options": {"delay_ms": 5}}},
    ) as d:
        restarted: list[str] = []

        async def kill_the_process() -> None:
            d.signal(killed, signal.SIGKILL)
            await asyncio.sleep(0)

        prompts = {f"s{i}": f"a{i} b{i}" for i in range(n)}
        async with supervised(d, restarted):
            report = await run_load(
                d, f"only {killed} SIGKILL, restarted", prompts, seed_final_2, concurrency,
                n // 4, kill_the_process,
            )  # fmt: skip
    print("\n" + header() + "\n" + report.line())
    assert restarted == [started_again], restarted
    assert (report.ok, report.lost, report.wrong, report.duplicated) == (n, 0, 0, 0), report
    # without `--replaces` the new process waits out the dead one's heartbeat or leases
    assert report.recovery_s is not None and report.recovery_s < TTL_S, report


def killed_by_an_input(redis_url: str, tmp_path: Path) -> FaultDeployment:
    """The seed pipeline whose stage 1 exits on a prompt holding "die", after 0.3 s of work
    (as every input: those before it are still in flight)."""
    stage = {"entry": "tests.http_stages:dies_on", "options": {"delay_s": 0.3}}
    return FaultDeployment(redis_url, tmp_path, "seed.yaml", stages={1: stage})


async def test_a_request_that_kills_each_replacement_fails_alone(
    redis_url: str, tmp_path: Path
) -> None:
    """As `serve` supervises (each process started in a dead one's place takes its inputs
    over, `--replaces`): an input that kills whoever runs it, with 9 others in flight
    beside it, kills three workers, the last while it runs alone (`isolation.py`), and is
    dead-lettered; the 9 beside it, counted as often, are not: they finish, each alone."""
    n = 20
    with killed_by_an_input(redis_url, tmp_path) as d:
        restarted: list[str] = []
        prompts = {f"r{i}": "please die" if i == n // 2 else f"a{i} b{i}" for i in range(n)}
        async with supervised(d, restarted):
            report = await run_load(d, "replaced, killed by its input, c=10", prompts, None, 10)
    print("\n" + header() + "\n" + report.line())
    assert (report.ok, report.failed, report.lost, report.duplicated) == (n - 1, 1, 0, 0), report
    assert "the last time alone" in next(iter(report.error_texts.values()))
    assert len(restarted) == 3, restarted


async def test_a_replacement_beats_before_it_deletes_the_dead_replicas_heartbeat(
    redis_url: str, tmp_path: Path
) -> None:
    """`--replaces` deletes the dead replica's heartbeat key at once. The replacement's own
    key must be there first: an orchestrator looking in between sees the stage with no
    live worker and fails every request in flight on it. Redis's keyspace events give
    the order of the two keys' writes."""
    with FaultDeployment(redis_url, tmp_path, "seed.yaml") as d:
        async with OmniClient(d.settings) as client:
            await client.wait_ready([0, 1, 2], timeout_s=60)
        beating = d.settings.names.heartbeat_pattern(1)
        (dead_key,) = (key.decode() for key in d.redis.scan_iter(beating))
        name, worker = next((n, p) for n, p, _f in d.group.procs if n.startswith("stage1"))
        d.redis.config_set("notify-keyspace-events", "Kg$")
        events = d.redis.pubsub()
        try:
            events.psubscribe(f"__keyspace@*__:{beating}")
            assert events.get_message(timeout=5)["type"] == "psubscribe"
            d.signal("stage1", signal.SIGKILL)
            assert await asyncio.to_thread(worker.wait, 30) == -signal.SIGKILL
            d.redis.pexpire(dead_key, 60_000)  # as if it had beaten just before it died
            assert d.group.restart_dead() == [name]
            seen: list[tuple[str, str]] = []
            while (dead_key, "del") not in seen:
                message = await asyncio.to_thread(events.get_message, True, 60)
                assert message is not None, f"no keyspace event in 60 s after {seen}"
                channel, event = message["channel"].decode(), message["data"].decode()
                seen.append((channel.split("__:", 1)[1], event))
        finally:
            events.close()
            d.redis.config_set("notify-keyspace-events", "")
    new_beats = [i for i, (key, event) in enumerate(seen) if key != dead_key and event == "set"]
    assert new_beats and new_beats[0] < seen.index((dead_key, "del")), seen


def idle_ms(d: FaultDeployment, stream: str) -> int:
    """How long the stage's one pending input has waited since it was last delivered."""
    (row,) = d.redis.xpending_range(stream, WORKERS_GROUP, min="-", max="+", count=2)
    return int(row["time_since_delivered"])


async def test_a_request_aborted_while_its_worker_was_down_is_not_run_by_the_next(
    redis_url: str, tmp_path: Path
) -> None:
    """The worker started in a dead one's place takes its inputs over; one whose client
    gave up while no worker was there (its abort on the control stream, which that worker
    did not live to read) is dropped, not run: here it would have killed it again."""
    with killed_by_an_input(redis_url, tmp_path) as d:
        async with OmniClient(d.settings) as client:
            await client.wait_ready([0, 1, 2], timeout_s=60)
            name, worker = next((n, p) for n, p, _f in d.group.procs if n.startswith("stage1"))
            stage_1 = d.settings.names.stage_in(1)
            beating = d.settings.names.heartbeat_pattern(1)
            dead_key = set(d.redis.scan_iter(beating))
            await client.submit("please die", request_id="gave-up")
            assert await asyncio.to_thread(worker.wait, 30) == 3
            await client.abort("gave-up")
            await wait_for(lambda: d.redis.xlen(d.settings.names.control) == 1)
            # idle past the replacement's claim fence: it takes the input over as it starts
            await wait_for(lambda: idle_ms(d, stage_1) > REPLACED_MIN_IDLE_MS)
            assert d.group.restart_dead() == [name]
            # the dead worker's heartbeat may outlive it, or lapse before its successor
            # beats (the stage then down for a moment): "next" goes to the successor
            await wait_for(lambda: bool(set(d.redis.scan_iter(beating)) - dead_key), 60)
            await client.submit("a b", request_id="next")
            outs = [out async for out in client.stream("next", timeout_s=30)]
            assert outs[-1].finished and outs[-1].error is None, outs[-1]
            await wait_for(lambda: d.redis.xpending(stage_1, WORKERS_GROUP)["pending"] == 0)
            assert d.group.restart_dead() == []  # it lives: it never ran the input


@pytest.mark.parametrize("concurrency", [1, 10])
async def test_a_worker_started_again_under_its_own_name_is_not_killed_for_good(
    redis_url: str, tmp_path: Path, concurrency: int
) -> None:
    """A supervisor that keeps a worker's name (`--worker-id`: a systemd unit, a pod's
    container restarted in place) starts it again on its own backlog: the input that
    killed it kills each new life until it has been delivered `OMNI_MAX_DELIVERIES` (3)
    times, the last time alone (`isolation.py`), then it is dead-lettered and its request
    fails alone; the rest are served, those in flight beside it in each life too."""
    n = 20
    with killed_by_an_input(redis_url, tmp_path) as d:
        d.signal("stage1", signal.SIGTERM)  # the group's own, replaced by this test's
        await asyncio.to_thread(d.group.procs[2][1].wait, 30)
        command = [
            sys.executable, "-m", "omni_runtime.cli", "worker", "--pipeline", str(d.path),
            "--mode", d.pipeline.mode, "--stage", "1", "--worker-id", "kept-name",
        ]  # fmt: skip
        lives: list[subprocess.Popen[bytes]] = []
        with open(tmp_path / "kept-name.log", "ab") as log:

            async def supervise() -> None:
                while True:
                    if not lives or lives[-1].poll() is not None:
                        lives.append(subprocess.Popen(command, env=d.env, stdout=log, stderr=log))
                    await asyncio.sleep(SUPERVISOR_PERIOD_S)

            task = asyncio.create_task(supervise())
            try:
                prompts = {f"k{i}": "please die" if i == n // 2 else f"a{i} b{i}" for i in range(n)}
                title = f"kept name, killed by its input, c={concurrency}"
                report = await run_load(d, title, prompts, None, concurrency)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                for life in lives:
                    life.terminate()
                    life.wait(30)
    print("\n" + header() + "\n" + report.line())
    assert (report.ok, report.failed, report.lost, report.duplicated) == (n - 1, 1, 0, 0), report
    assert "delivered 3 times without finishing" in next(iter(report.error_texts.values()))
    assert [life.returncode for life in lives[:3]] == [3, 3, 3] and len(lives) == 4


async def test_the_only_replica_stalled_is_killed_and_started_again(
    redis_url: str, tmp_path: Path
) -> None:
    """SIGSTOP: alive but silent, it would never exit, and `restart_dead` would wait on it
    for good. Once its heartbeat has been gone `STALL_TTLS` TTLs, the supervision kills
    it and starts it again: what was in flight fails (its stage had no live worker),
    nothing is lost or repeated, and the stage serves again."""
    n, concurrency, ttl_s = 120, 10, 2.5
    with FaultDeployment(
        redis_url,
        tmp_path,
        "seed.yaml",
        env={"OMNI_HEARTBEAT_TTL_S": str(ttl_s)},
        final_stage_ids=[2],
        stages={1: {"options": {"delay_ms": 50}}},
    ) as d:
        restarted: list[str] = []

        async def stall_the_replica() -> None:
            d.signal("stage1", signal.SIGSTOP)
            await asyncio.sleep(0)

        prompts = {f"t{i}": f"a{i} b{i}" for i in range(n)}
        async with supervised(d, restarted):
            stalled = await run_load(
                d, "only stage1 SIGSTOP, supervised", prompts, seed_final_2, concurrency,
                n // 4, stall_the_replica,
            )  # fmt: skip
            await wait_for(lambda: bool(restarted), deadline_s=(STALL_TTLS + 2) * ttl_s + 10)
            again = {f"u{i}": f"c{i} d{i}" for i in range(n)}
            after = await run_load(d, "after it, started again", again, seed_final_2, concurrency)
    print("\n" + header() + "\n" + stalled.line() + "\n" + after.line())
    assert restarted == ["stage1-upper_all-0"], restarted
    assert (stalled.lost, stalled.wrong, stalled.duplicated) == (0, 0, 0), stalled
    assert set(stalled.errors) == {"no live worker for stage 1"}, stalled.error_texts
    assert (after.ok, after.lost) == (n, 0), after
