"""A client that submits and never reads: past its buffer bound each request is aborted at
every stage and its buffer freed; reading later gives one error final per request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_runtime.client.client import OmniClient
from tests.faults.harness import FULL, FaultDeployment
from tests.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]

BUFFER = 8


async def test_a_client_that_never_reads_is_bounded_and_its_requests_end(
    redis_url: str, tmp_path: Path
) -> None:
    n = 200 if FULL else 40
    fast = {0: {"options": {"token_delay_ms": 1}}, 1: {"options": {"code_delay_ms": 0}}}
    with FaultDeployment(redis_url, tmp_path, "omni.yaml", stages=fast) as d:
        settings = d.settings.model_copy(update={"client_buffer_outputs": BUFFER})
        prompt = " ".join(f"word{i}" for i in range(40))  # 80 outputs, 10x the buffer
        async with OmniClient(settings) as client:
            await client.wait_ready([0, 1, 2], timeout_s=60)
            rids = [await client.submit(prompt, request_id=f"nr{i}") for i in range(n)]

            def aborted() -> float:
                return client.metrics.value("omni_aborts_total", reason="client buffer full")

            await wait_for(lambda: aborted() == n, deadline_s=120)
            assert all(
                len(p.queue._queue) <= BUFFER  # type: ignore[attr-defined]
                for p in client.inbox.requests.values()
            )
            finals = {rid: [o async for o in client.stream(rid, timeout_s=30)] for rid in rids}
        for rid, outs in finals.items():
            assert len(outs) == 1 and outs[0].finished, rid
            assert outs[0].error is not None and "client buffer full" in outs[0].error

        def workers_idle() -> bool:
            values = d.redis.mget(d.redis.keys(f"{d.namespace}:hb:stage:*"))
            docs = [json.loads(v) for v in values if v is not None]
            return len(docs) == 3 and all(doc["in_flight"] == 0 for doc in docs)

        await wait_for(workers_idle, deadline_s=60)  # aborted at every stage, not run out
