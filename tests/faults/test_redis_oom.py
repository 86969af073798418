"""Redis out of memory (`maxmemory` with `noeviction`, a production Redis's usual setting):
no process exits; every request ends with exactly one final, a success or an error naming
the condition, within its deadline and the client's grace; no entry reaches the client
twice; a submission while Redis refuses writes fails at once with the OOM error. Once
maxmemory is raised, requests succeed exactly again.

Two shapes: memory that runs short under a load (maxmemory = what Redis uses at rest +
3 MB, 16 KB prompts), and Redis refusing every write for longer than a lease while
requests are in flight (two orchestrators: neither may depose the other)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from omni_runtime.client.client import OmniClient
from omni_runtime.core.types import OrchOutput
from omni_runtime.errors import OOM_MESSAGE, RedisOutOfMemoryError
from tests.faults.harness import FULL, FaultDeployment, seed_final_2
from tests.faults.orchestrators import wait_for_slots
from tests.faults.private_redis import PrivateRedis
from tests.waiting import wait_for

pytestmark = [pytest.mark.solo, pytest.mark.timeout(300)]

HEADROOM_BYTES = 3 * 1024 * 1024
"""maxmemory is set to what Redis uses at rest plus this."""
PROMPT_BYTES = 16 * 1024
SUBMIT_REFUSED_WITHIN_S = 0.1
LATE_SLACK_S = 0.5
"""The client's own deadline fires on its event loop: under load, a little late."""


@dataclass
class OomLoad:
    """What one load saw, per request: its outputs, or its refusal at submission."""

    outcomes: dict[str, list[OrchOutput]] = field(default_factory=dict)
    took_s: dict[str, float] = field(default_factory=dict)
    """Submission to final (or to the refusal)."""
    refused_s: dict[str, float] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)
    no_final: list[str] = field(default_factory=list)
    submitted: list[str] = field(default_factory=list)
    """Requests whose submission returned: written to Redis, in flight."""

    def finals(self) -> dict[str, str | None]:
        """request id → its final's error (None: a success)."""
        return {rid: outs[-1].error for rid, outs in self.outcomes.items()}


async def oom_load(
    client: OmniClient,
    prompts: dict[str, str],
    concurrency: int,
    deadline_s: float,
    load: OomLoad | None = None,
) -> OomLoad:
    """`load`: filled as it goes, for a caller that waits on its progress."""
    load = load if load is not None else OomLoad()
    queue = list(prompts.items())

    async def worker() -> None:
        while queue:
            rid, prompt = queue.pop(0)
            t0 = time.monotonic()
            try:
                await client.submit(prompt, request_id=rid, deadline_s=deadline_s)
            except RedisOutOfMemoryError as e:
                load.refused_s[rid] = time.monotonic() - t0
                load.refusals[rid] = str(e)
                continue
            load.submitted.append(rid)
            outs: list[OrchOutput] = []
            try:
                async for out in client.stream(rid, timeout_s=3 * deadline_s):
                    outs.append(out)
            except TimeoutError:
                load.no_final.append(rid)
                continue
            load.took_s[rid] = time.monotonic() - t0
            load.outcomes[rid] = outs

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return load


def exited(d: FaultDeployment) -> dict[str, int | None]:
    """Each process's exit code (None: running); the log tail of any that exited."""
    codes = {name: proc.poll() for name, proc, _f in d.group.procs}
    for name, code in codes.items():
        if code is not None:
            print(f"\n{name} exited {code}:\n{d.group.tail(name, 60)}")
    return codes


def big_prompt(i: int) -> str:
    return f"{'x' * PROMPT_BYTES}{i} r{i}"


async def test_redis_out_of_memory_ends_every_request_clearly_and_in_time(tmp_path: Path) -> None:
    n, concurrency, deadline_s = (600, 100, 15.0) if FULL else (300, 100, 6.0)
    grace_s = 2.0
    env = {"OMNI_DEADLINE_S": str(deadline_s)}
    with (
        PrivateRedis(tmp_path) as server,
        FaultDeployment(
            server.url,
            tmp_path,
            "seed.yaml",
            env=env,
            final_stage_ids=[2],
            stages={1: {"options": {"delay_ms": 20}}},
        ) as d,
    ):
        settings = d.settings.model_copy(update={"deadline_s": deadline_s})
        async with OmniClient(settings) as client:
            await client.wait_ready(list(range(d.pipeline.last_stage + 1)), timeout_s=60)
            used = int(d.redis.info("memory")["used_memory"])
            d.redis.config_set("maxmemory-policy", "noeviction")
            d.redis.config_set("maxmemory", used + HEADROOM_BYTES)
            prompts = {f"m{i}": big_prompt(i) for i in range(n)}
            load = await oom_load(client, prompts, concurrency, deadline_s)
            oom_refusals = client.metrics.value("omni_redis_oom_refusals_total")
            d.redis.config_set("maxmemory", 0)
            after = {f"a{i}": f"a{i} b{i}" for i in range(200)}
            again = await oom_load(client, after, concurrency, deadline_s)
            duplicates = client.metrics.value("omni_duplicate_outputs_total", source="client")
            dropped = client.dropped_outputs
        exits = exited(d)
    finals = load.finals()
    errors: dict[str, int] = {}
    for error in finals.values():
        if error is not None:
            errors[error[:60]] = errors.get(error[:60], 0) + 1
    ok = sum(
        1
        for rid, outs in load.outcomes.items()
        if [(o.stage_id, o.data, o.finished) for o in outs] == seed_final_2(prompts[rid])
    )
    print(
        f"\nOOM: {n} requests at c={concurrency}, deadline {deadline_s:g} s: {ok} ok, "
        f"{len(finals) - ok} failed, {len(load.refused_s)} refused at submission "
        f"(slowest {max(load.refused_s.values(), default=0) * 1000:.1f} ms), "
        f"{len(load.no_final)} without a final; slowest final "
        f"{max(load.took_s.values(), default=0):.2f} s after submission; "
        f"{oom_refusals:.0f} OOM refusals seen by the client; errors {errors}; "
        f"after maxmemory raised: {sum(e is None for e in again.finals().values())}/200"
    )
    assert all(code is None for code in exits.values()), exits
    assert load.no_final == [] and again.no_final == []
    assert len(load.outcomes) + len(load.refused_s) == n
    for rid, outs in load.outcomes.items():
        assert [o for o in outs if o.finished] == [outs[-1]], rid  # exactly one final
        error = outs[-1].error
        if error is None:
            assert [(o.stage_id, o.data, o.finished) for o in outs] == seed_final_2(prompts[rid])
        else:
            assert OOM_MESSAGE in error or error == "deadline exceeded", error
    assert max(load.took_s.values()) <= deadline_s + grace_s + LATE_SLACK_S
    assert oom_refusals > 0, "Redis never ran out of memory: the scenario tested nothing"
    assert max(load.refused_s.values(), default=0) <= SUBMIT_REFUSED_WITHIN_S
    assert all(r.startswith(OOM_MESSAGE) for r in load.refusals.values())
    assert (duplicates, dropped) == (0, 0)
    assert all(
        [(o.stage_id, o.data, o.finished) for o in outs] == seed_final_2(after[rid])
        for rid, outs in again.outcomes.items()
    )
    assert len(again.outcomes) == 200


async def test_redis_refusing_every_write_ends_requests_in_flight_at_their_deadline(
    tmp_path: Path,
) -> None:
    """Every write refused for longer than the orchestrators' lease and heartbeat TTLs:
    requests in flight end at their deadline and the client's grace, saying Redis is out
    of memory; submissions are refused at once; no orchestrator deposes another, no
    worker is taken for dead; once maxmemory is raised, all is well again."""
    n, deadline_s = (100, 15.0) if FULL else (40, 6.0)
    grace_s = 2.0
    with (
        PrivateRedis(tmp_path) as server,
        FaultDeployment(
            server.url,
            tmp_path,
            "seed.yaml",
            orchestrators=2,
            env={"OMNI_DEADLINE_S": str(deadline_s)},
            final_stage_ids=[2],
            stages={1: {"options": {"delay_ms": 500}}},
        ) as d,
    ):
        settings = d.settings.model_copy(update={"deadline_s": deadline_s})
        async with OmniClient(settings) as client:
            await client.wait_ready(list(range(d.pipeline.last_stage + 1)), timeout_s=60)
            await wait_for_slots(d.redis, d.settings.names, 2)  # both started before Redis fills
            last_out = d.settings.names.stage_out(d.pipeline.last_stage, 1)
            await wait_for(lambda: bool(d.redis.exists(last_out)), deadline_s=30)
            prompts = {f"f{i}": f"a{i} b{i}" for i in range(n)}
            in_flight = OomLoad()
            load = asyncio.create_task(oom_load(client, prompts, n, deadline_s, in_flight))
            # Submitted, not only opened at the client: its XADD may still be on its way.
            await wait_for(lambda: len(in_flight.submitted) == n, deadline_s=30)
            d.redis.config_set("maxmemory-policy", "noeviction")
            d.redis.config_set("maxmemory", 1)  # every write refused from now on
            full_at = time.monotonic()
            refused_s = []
            for i in range(10):
                t0 = time.monotonic()
                with pytest.raises(RedisOutOfMemoryError, match=f"^{OOM_MESSAGE}"):
                    await client.submit("x y", request_id=f"shed{i}")
                refused_s.append(time.monotonic() - t0)
            await load
            full_for_s = time.monotonic() - full_at
            d.redis.config_set("maxmemory", 0)
            after = {f"a{i}": f"a{i} b{i}" for i in range(200)}
            again = await oom_load(client, after, 50, deadline_s)
        exits = exited(d)
    finals = in_flight.finals()
    print(
        f"\nRedis refusing every write for {full_for_s:.1f} s, {n} requests in flight, "
        f"deadline {deadline_s:g} s: finals {sorted(set(map(str, finals.values())))[:3]}; "
        f"slowest {max(in_flight.took_s.values()):.2f} s after submission; submissions "
        f"refused in {max(refused_s) * 1000:.1f} ms at most; after maxmemory raised: "
        f"{sum(e is None for e in again.finals().values())}/200"
    )
    assert all(code is None for code in exits.values()), exits
    assert full_for_s > 5.0  # past the lease and heartbeat TTLs
    assert in_flight.no_final == [] and len(finals) == n
    for rid, outs in in_flight.outcomes.items():
        assert [o for o in outs if o.finished] == [outs[-1]], rid
        error = outs[-1].error
        assert error is not None and OOM_MESSAGE in error, error
        assert "no live worker" not in error
    assert max(in_flight.took_s.values()) <= deadline_s + grace_s + LATE_SLACK_S
    assert max(refused_s) <= SUBMIT_REFUSED_WITHIN_S
    assert len(again.outcomes) == 200
    assert all(
        [(o.stage_id, o.data, o.finished) for o in outs] == seed_final_2(after[rid])
        for rid, outs in again.outcomes.items()
    )
