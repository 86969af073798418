"""One mode per deployment: the orchestrator and the workers of a namespace must all run
the pipeline sequentially or all streaming.

A worker of the other mode used to log "ready" and then fail every request it took.
Now each says its mode in its heartbeat, and whichever process starts second, seeing
a live one of the other mode, refuses to start with one line naming both (exit 2).
Each request still carries its mode, so one that slips past (two started at once)
fails with the same advice (`worker/core.py`).
"""

from __future__ import annotations

import json
from typing import Any

import redis
import redis.asyncio as aioredis

from omni_runtime import keys
from omni_runtime.errors import ConfigError
from omni_runtime.observe.redis_stats import parse_heartbeat
from omni_runtime.pipeline import PipelineConfig

MAX_WORKERS_LOOKED_AT = 256
"""Heartbeats read per stage at an orchestrator's start: one of the other mode is enough."""


def orchestrator_beat(pipeline: PipelineConfig) -> str:
    """The orchestrator heartbeat's value: the pipeline's name and its mode."""
    return json.dumps({"pipeline": pipeline.name, "mode": pipeline.mode}, separators=(",", ":"))


def _mismatch(own: str, other: str, who: str, where: str) -> ConfigError:
    return ConfigError(
        f"{who} of namespace {where!r} runs {other} mode, this process {own}: start every "
        f"process of a deployment with the same --mode (or none, and the file's `mode:`)"
    )


def _mode_of(raw: Any) -> str | None:
    mode = parse_heartbeat(raw).get("mode")
    return mode if isinstance(mode, str) else None


def check_worker_mode(client: redis.Redis, names: keys.Names, pipeline: PipelineConfig) -> None:
    """At a worker's start: a live orchestrator of the other mode is a `ConfigError`."""
    mode = _mode_of(client.get(names.orchestrator_heartbeat()))
    if mode is not None and mode != pipeline.mode:
        raise _mismatch(pipeline.mode, mode, "the orchestrator", names.namespace)


async def check_orchestrator_mode(
    client: aioredis.Redis, names: keys.Names, pipeline: PipelineConfig
) -> None:
    """At an orchestrator's start: a live orchestrator or worker of the other mode is a
    `ConfigError` (SCAN per stage: once, at start)."""
    mode = _mode_of(await client.get(names.orchestrator_heartbeat()))
    if mode is not None and mode != pipeline.mode:
        raise _mismatch(pipeline.mode, mode, "an orchestrator", names.namespace)
    for sid in range(pipeline.last_stage + 1):
        found = []
        async for key in client.scan_iter(names.heartbeat_pattern(sid), count=1000):
            found.append(key)
            if len(found) >= MAX_WORKERS_LOOKED_AT:
                break
        for key in found:
            mode = _mode_of(await client.get(key))
            if mode is not None and mode != pipeline.mode:
                raise _mismatch(pipeline.mode, mode, f"a worker of stage {sid}", names.namespace)
