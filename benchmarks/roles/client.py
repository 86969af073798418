"""Load client: one `OmniClient` running loads on command from the coordinator.

`python -m benchmarks.roles.client --namespace NS --stages 0,1,2` (Redis, namespace and
trace file from `OMNI_*`). Prints `{"ready"}` once the pipeline is up, then per
`{"n", "concurrency", "gap_ms", "tag", "start_at_ns", "prompt", "expect"}` line on
stdin runs `n` requests with at most `concurrency` in flight and prints the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

from benchmarks.harness.procs import STARTUP_TIMEOUT_S
from benchmarks.roles import emit
from omni_runtime.client.client import OmniClient
from omni_runtime.settings import Settings

REQUEST_TIMEOUT_S = 30.0


async def run_requests(client: OmniClient, cmd: dict[str, Any]) -> dict[str, Any]:
    """Run one load; latencies are submit -> finished output, in CLOCK_MONOTONIC ns."""
    delay_s = (cmd["start_at_ns"] - time.monotonic_ns()) / 1e9
    if delay_s > 0:
        await asyncio.sleep(delay_s)  # clients of one load start together
    slots = asyncio.Semaphore(cmd["concurrency"])
    expect = [tuple(x) for x in cmd["expect"]] if cmd.get("expect") else None
    latencies: list[int] = []
    errors: list[str] = []

    async def one(i: int) -> None:
        async with slots:
            rid = f"{cmd['tag']}-{i}"
            t0 = time.monotonic_ns()
            try:
                await client.submit(cmd["prompt"], request_id=rid)
                outs = [
                    (o.stage_id, o.data, o.finished)
                    async for o in client.stream(rid, timeout_s=REQUEST_TIMEOUT_S)
                ]
            except Exception as e:  # counted, the load goes on
                errors.append(f"{rid}: {type(e).__name__}: {e}")
            else:
                latencies.append(time.monotonic_ns() - t0)
                if expect is not None and outs != expect:
                    errors.append(f"{rid}: unexpected outputs {outs}")
            if cmd["gap_ms"] > 0:
                await asyncio.sleep(random.uniform(0.8, 1.2) * cmd["gap_ms"] / 1e3)

    t_start, cpu0 = time.monotonic_ns(), time.process_time()
    await asyncio.gather(*(one(i) for i in range(cmd["n"])))
    return {
        "t_start_ns": t_start,
        "t_end_ns": time.monotonic_ns(),
        "cpu_s": time.process_time() - cpu0,
        "latencies_ns": latencies,
        "errors": errors[:20],
        "n_errors": len(errors),
    }


async def serve(settings: Settings, stage_ids: list[int]) -> None:
    loop = asyncio.get_running_loop()
    async with OmniClient(settings) as client:
        await client.wait_ready(stage_ids, timeout_s=STARTUP_TIMEOUT_S)
        emit({"ready": True, "pid": os.getpid()})
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd: dict[str, Any] = json.loads(line)
            emit(await run_requests(client, cmd))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--stages", default="0,1,2")
    args = parser.parse_args()
    settings = Settings(namespace=args.namespace)
    asyncio.run(serve(settings, [int(s) for s in args.stages.split(",")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
