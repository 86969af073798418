"""Malformed entries flooding the requests stream and every stage's output stream, between
good requests: no process crashes, every one is counted and dead-lettered (the dead-letter
stream grows by exactly that many), every good request is exact."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from omni_runtime.redis_io.write_ops import xadd_fields
from omni_runtime.wire import codec
from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2
from tests.waiting import wait_for

pytestmark = [pytest.mark.timeout(600), pytest.mark.redis_server]

BATCH = 100


def malformed(i: int) -> dict[str, Any]:
    """Five kinds of bad entry: not msgpack, no `type`, an id sent as bytes, a wrong
    field name, an unknown message type."""
    kinds: list[dict[str, Any]] = [
        {"m": b"\xc1not msgpack"},
        {"m": codec.encode({"request_id": f"x{i}", "data": 1})},
        {"m": codec.encode({"type": "stage_output", "request_id": b"x", "finished": True})},
        {"payload": codec.encode({"type": "request"})},
        {"m": codec.encode({"type": "bogus", "request_id": f"x{i}"})},
    ]
    return kinds[i % len(kinds)]


async def test_malformed_flood_is_dead_lettered_and_harms_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency, per_stream = (2000, 200, 10_000) if FULL else (200, 50, 300)
    with FaultDeployment(redis_url, tmp_path, "seed.yaml", final_stage_ids=[2]) as d:
        names = d.settings.names
        streams = [names.requests, *(names.stage_out(k) for k in range(3))]
        dead_before = dead_added(d)

        def flood() -> None:
            for start in range(0, per_stream, BATCH):
                with d.redis.pipeline(transaction=False) as pipe:
                    for i in range(start, min(start + BATCH, per_stream)):
                        for stream in streams:
                            pipe.xadd(stream, xadd_fields(malformed(i)))
                    pipe.execute()

        async def flood_between_requests() -> None:
            await asyncio.to_thread(flood)

        prompts = {f"m{i}": f"a{i} b{i}" for i in range(n)}
        report = await run_load(
            d, "malformed flood", prompts, seed_final_2, concurrency, 1, flood_between_requests
        )
        sent = per_stream * len(streams)
        await wait_for(lambda: dead_added(d) >= dead_before + sent, deadline_s=60)
        dead = dead_added(d) - dead_before
        d.group.check_alive()
    print("\n" + header() + "\n" + report.line() + f"  malformed={sent} dead-lettered={dead}")
    assert (report.ok, report.wrong, report.lost, report.failed) == (n, 0, 0, 0), report
    assert dead == sent


def dead_added(d: FaultDeployment) -> int:
    """Entries ever added to the dead-letter stream (MAXLEN trimming does not lower it)."""
    key = d.settings.names.dead_letters
    if not d.redis.exists(key):
        return 0
    return int(d.redis.xinfo_stream(key)["entries-added"])
