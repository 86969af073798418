"""Faults on the real voice pipeline (SmolLM2 on llama.cpp → piper), as real processes:
an abort mid-generation frees the thinker's slot for the request waiting on it and
leaves no stage working on it; a thinker replica SIGKILLed under load has its requests
taken over, each ending once, with no chunk repeated or missing."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_runtime.client.client import OmniClient
from omni_runtime.core.types import OrchOutput
from tests.e2e.test_real_voice import needs_engines  # noqa: F401 (a module-wide fixture)
from tests.faults.harness import WORKERS, FaultDeployment, header, run_load

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]

THINKER = yaml.safe_load((WORKERS / "voice.yaml").read_text())["stages"][0]["options"]
LONG = "Write a long story about a dragon and a knight, with many details."
"""A prompt SmolLM2 answers at length: it is still writing when the test aborts it."""


def thinker(**options: Any) -> dict[int, dict[str, Any]]:
    return {0: {"options": {**THINKER, **options}}}


def engine(docs: list[dict[str, Any]]) -> dict[str, int]:
    """The thinker's engine counts (running, waiting, capacity) from its heartbeat."""
    return dict(docs[0]["engine"]) if docs else {"running": -1, "waiting": -1}


async def first_text(client: OmniClient, rid: str, seen: asyncio.Event) -> list[OrchOutput]:
    outs = []
    async for out in client.stream(rid, timeout_s=120):
        outs.append(out)
        if out.stage_id == 0 and out.data:
            seen.set()
    return outs


async def test_an_abort_frees_the_slot_at_once_and_no_stage_keeps_the_request(
    redis_url: str, tmp_path: Path
) -> None:
    with FaultDeployment(
        redis_url, tmp_path, "voice.yaml", mode="streaming", stages=thinker(n_parallel=1)
    ) as d:
        async with OmniClient(d.settings) as client:
            await client.wait_ready([0, 1, 2], timeout_s=120)
            a_started, b_started = asyncio.Event(), asyncio.Event()
            a = await client.submit(LONG, params={"max_tokens": 400, "seed": 1})
            a_outs = asyncio.create_task(first_text(client, a, a_started))
            await asyncio.wait_for(a_started.wait(), 60)
            b = await client.submit(LONG, params={"max_tokens": 400, "seed": 2})
            b_outs = asyncio.create_task(first_text(client, b, b_started))
            # b waits for the only slot: the thinker reports it as waiting
            docs = await d.wait_worker_status(
                0, lambda ds: bool(ds) and engine(ds)["waiting"] == 1, 30
            )
            assert engine(docs)["waiting"] == 1 and engine(docs)["running"] == 1, docs
            assert not b_started.is_set()

            aborted_at = time.monotonic()
            await client.abort(a)
            await asyncio.wait_for(b_started.wait(), 30)
            b_waited_s = time.monotonic() - aborted_at
            outs = await asyncio.wait_for(a_outs, 30)
            assert outs[-1].finished and outs[-1].error is not None
            assert "abort" in outs[-1].error, outs[-1]
            # No stage still holds a: each has at most b in flight, while b still runs.
            docs = await d.wait_worker_status(
                0,
                lambda ds: bool(ds) and engine(ds)["running"] == 1 and engine(ds)["waiting"] == 0,
                10,
            )
            assert (engine(docs)["running"], engine(docs)["waiting"], docs[0]["in_flight"]) == (
                1,
                0,
                1,
            )
            for stage in (1, 2):
                held = await d.wait_worker_status(stage, lambda ds: ds[0]["in_flight"] <= 1, 10)
                assert held[0]["in_flight"] <= 1, (stage, held)
            assert not b_outs.done()  # b is still writing: the slot went to it, not to idleness
            await client.abort(b)
            await asyncio.wait_for(b_outs, 30)
            settled = await d.wait_worker_status(
                0, lambda ds: ds[0]["in_flight"] == 0 and engine(ds)["running"] == 0, 10
            )
            assert (settled[0]["in_flight"], engine(settled)["running"]) == (0, 0), settled
            assert client.dropped_outputs == 0
    # Had a kept its slot, b would have waited for a's 400 tokens (several seconds).
    print(f"\nb started {b_waited_s * 1e3:.0f} ms after a's abort (benchmarks measure it)")


def voice_outputs(outs: list[OrchOutput]) -> tuple[str, int]:
    """(the answer's text, its audio chunks) of a request that ended with a success."""
    text = "".join(str(o.data) for o in outs if o.stage_id == 0 and o.data)
    return text, sum(1 for o in outs if o.stage_id == 2 and o.data is not None)


async def test_sigkill_of_a_thinker_replica_under_load_ends_every_request_once(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = 12, 4
    prompts = {f"q{i}": f"Tell me one fact about the number {i}." for i in range(n)}
    heard: dict[str, tuple[str, int]] = {}
    with FaultDeployment(
        redis_url,
        tmp_path,
        "voice.yaml",
        mode="streaming",
        stages={0: {"replicas": 2, "options": {**THINKER, "n_threads": 1}}},
        env={"OMNI_HEARTBEAT_TTL_S": "5"},
    ) as d:

        async def kill_one_thinker() -> None:
            d.signal("stage0", signal.SIGKILL)
            await asyncio.sleep(0)

        outcomes: dict[str, list[OrchOutput]] = {}
        async with OmniClient(d.settings) as watcher:
            await watcher.wait_ready([0, 1, 2], timeout_s=120)
        report = await run_load(
            d, "real thinker replica SIGKILL (c=4)", prompts, None, concurrency,
            fault_after=concurrency + 1, fault=kill_one_thinker, timeout_s=60, deadline_s=240,
            keep=outcomes,
        )  # fmt: skip
        for rid, outs in outcomes.items():
            heard[rid] = voice_outputs(outs)
    print("\n" + header() + "\n" + report.line())
    # Every request ended once, with its answer: none lost, none failed, none repeated.
    assert (report.lost, report.failed, report.duplicated) == (0, 0, 0), report
    assert report.late_successes == {}, report
    assert all(len(outs) and outs[-1].finished for outs in outcomes.values())
    assert all(sum(o.finished for o in outs) == 1 for outs in outcomes.values())
    for rid, (text, audio_chunks) in heard.items():
        assert text.strip() and audio_chunks > 0, (rid, text, audio_chunks)
    assert report.recovery_s is not None, report
