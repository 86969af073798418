"""Memory follows live requests: 100,000 aborted requests leave nothing behind in the router
or the worker's core beyond a bounded memory of recent aborts."""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

import pytest

from omni_runtime import Orchestrator
from omni_runtime.core.types import StageOutput
from omni_runtime.observe.metrics import Metrics
from omni_runtime.stage_api import EngineOutput
from omni_runtime.wire.messages import StageInputMsg
from omni_runtime.worker.actions import Input
from omni_runtime.worker.core import WorkerCore

N = 100_000
GROWTH_LIMIT_BYTES = 4 * 1024 * 1024
"""Far below what remembering 100,000 requests would take (~15 MB of dict entries and ids)."""

pytestmark = pytest.mark.timeout(120)


class SilentStage:
    """Takes inputs, never answers: every request stays live until it is aborted."""

    async def submit(
        self, request_id: str, data: Any, params: dict[str, Any] | None = None
    ) -> None:
        return None

    async def get_output(self) -> list[StageOutput]:
        await asyncio.Event().wait()
        return []


class IdleEngine:
    def add_request(self, request_id: str, data: Any) -> None:
        return None

    def has_work(self) -> bool:
        return False

    def step(self) -> list[EngineOutput]:
        return []

    def abort(self, request_id: str) -> None:
        return None


def rss_bytes() -> int:
    """This process's resident set (after a collection), from /proc."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def growth_of(run: Any, warm_up: Any) -> int:
    warm_up()  # arenas and caches reach their working size first
    before = rss_bytes()
    run()
    return rss_bytes() - before


async def test_the_router_forgets_aborted_requests() -> None:
    stages = [SilentStage(), SilentStage()]
    async with Orchestrator(stages, [1], default_deadline_s=600) as orch:

        async def cycle(prefix: str, n: int, batch: int = 1000) -> None:
            for start in range(0, n, batch):
                rids = [f"{prefix}{i}" for i in range(start, start + batch)]
                for rid in rids:
                    await orch.add_request(rid, "x")
                    await orch.abort_request(rid)
                for _ in rids:  # each its one final: the abort
                    assert (await orch.next_output(timeout=10)).error == "aborted"

        await cycle("warm", 20_000)
        before = rss_bytes()
        await cycle("r", N)
        growth = rss_bytes() - before
        assert orch.request_states == {}
    assert growth < GROWTH_LIMIT_BYTES, f"{growth / 1e6:.1f} MB kept after {N} aborts"


def test_the_worker_core_keeps_a_bounded_memory_of_aborts() -> None:
    core = WorkerCore(
        IdleEngine(),
        1,
        "idle",
        sends_chunks=False,
        receives_chunks=False,
        max_message_bytes=1 << 20,
        input_timeout_s=60.0,
        metrics=Metrics(),
    )

    def cycle(prefix: str, n: int) -> None:
        for i in range(n):
            rid = f"{prefix}{i}"
            core.on_input(Input(b"1-0", StageInputMsg(request_id=rid, data="x")), 0.0)
            core.on_abort(rid, 0.0)
            core.take_actions()

    growth = growth_of(lambda: cycle("r", N), lambda: cycle("warm", 20_000))
    assert core.in_flight == 0
    assert growth < GROWTH_LIMIT_BYTES, f"{growth / 1e6:.1f} MB kept after {N} aborts"
