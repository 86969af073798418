"""A replica SIGTERMed while it holds a request longer than its drain deadline: it exits 0 at
the deadline and hands the input back, and the other replica runs it at once — not after the
heartbeat TTL a takeover of a dead replica's inputs waits for. The client sees one exact
answer."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from omni_runtime import keys
from omni_runtime.client.client import OmniClient
from tests.faults.harness import FaultDeployment

pytestmark = [pytest.mark.solo, pytest.mark.timeout(300), pytest.mark.redis_server]

DRAIN_S = 0.3
DELAY_S = 2.0
"""Stage 1's work per request: far longer than the drain."""
TAKEOVER_S = 5.0
"""What a takeover would wait instead: the input idle for a heartbeat TTL (5 s here)."""


async def test_a_drained_replica_hands_back_what_it_cannot_finish(
    redis_url: str, tmp_path: Path
) -> None:
    with FaultDeployment(
        redis_url,
        tmp_path,
        "seed.yaml",
        env={"OMNI_DRAIN_S": str(DRAIN_S)},
        final_stage_ids=[2],
        stages={1: {"replicas": 2, "options": {"delay_ms": DELAY_S * 1000}}},
    ) as d:
        async with OmniClient(d.settings) as client:
            await client.wait_ready([0, 1, 2], timeout_s=60)
            rid = await client.submit("hand me back")
            stream = d.settings.names.stage_in(1)
            deadline = time.monotonic() + 30
            holder = None
            while holder is None:  # which replica read it: its consumer name is the group's
                assert time.monotonic() < deadline, "stage 1 never read the input"
                pending = d.redis.xpending(stream, keys.WORKERS_GROUP)
                names = [c["name"].decode() for c in pending.get("consumers") or []]
                holder = names[0] if names else None
                await asyncio.sleep(0.01)
            (proc,) = [p for n, p, _f in d.group.procs if d.group.process_ids.get(n) == holder]
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, DRAIN_S + 5)
            exited_s = time.monotonic() - sent
            outs = [o async for o in client.stream(rid, timeout_s=30)]
            done_s = time.monotonic() - sent
    assert code == 0 and exited_s <= DRAIN_S + 1.0, (code, exited_s)
    assert [(o.stage_id, o.data, o.finished, o.error) for o in outs] == [
        (2, "wav:HAND", False, None),
        (2, "wav:ME", False, None),
        (2, "wav:BACK", True, None),
    ]
    assert done_s < DRAIN_S + DELAY_S + 1.5 < TAKEOVER_S, done_s
