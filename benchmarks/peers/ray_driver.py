"""The Ray side of `python -m benchmarks.peers`, as its own process (every Ray process its child).

Starts a local Ray instance (2 CPUs, no dashboard, no HTTP proxy: the client is a handle
from this driver), deploys the applications of `benchmarks.peers.ray_serve` named as
arguments (default: sequential and streaming), prints
`{"ready": ..., "deploy_s": ...}`, then for each JSON line on stdin
`{"mode", "concurrency", "n"}` runs `benchmarks.peers.load.closed_loop` against that
mode and prints `{"samples": ...}`. EOF on stdin shuts Ray down. Running apart keeps
Ray's CPU in one process tree (this process and its descendants), measured from outside.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import traceback
from collections.abc import AsyncIterator
from typing import Any

from benchmarks.peers.load import closed_loop

OBJECT_STORE_BYTES = 256 * 2**20
"""Ray's default is 30 % of memory; the demo's chunks need a few MB."""


def say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def main() -> int:
    try:
        import ray
        from ray import serve

        from benchmarks.peers.ray_serve import MODES, app, streamed
    except ImportError as e:
        say({"error": str(e)})
        return 1
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
             log_to_driver=False, logging_level=logging.WARNING)  # fmt: skip
    try:
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        handles = {
            m: serve.run(app(m), name=m, route_prefix=None).options(stream=True)
            for m in sys.argv[1:] or MODES[:2]
        }

        def source(mode: str) -> Any:
            async def stream(prompt: str) -> AsyncIterator[tuple[int, Any]]:
                async for batch in streamed(handles[mode].stream.remote(prompt)):
                    for stage, data in batch:  # the items ready at once, in one message
                        yield stage, data

            return stream

        say({"ready": True, "deploy_s": time.perf_counter() - t0})
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                samples = asyncio.run(
                    closed_loop(source(cmd["mode"]), int(cmd["concurrency"]), int(cmd["n"]))
                )
            except Exception:
                say({"error": traceback.format_exc(limit=5)})
                continue
            say({"samples": samples.to_json()})
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
