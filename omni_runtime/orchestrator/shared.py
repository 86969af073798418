"""What every slot an orchestrator process serves shares, built once by the process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.timings import RequestTimer
from omni_runtime.observe.tracing import Tracer
from omni_runtime.orchestrator.leases import Leases
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.redis_io.liveness import StageWatch
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.settings import Settings


@dataclass
class Shared:
    """What every slot of one process shares: one client, one writer, one lease set."""

    pipeline: PipelineConfig
    settings: Settings
    client: aioredis.Redis
    writer: StreamWriter
    leases: Leases
    metrics: Metrics
    timer: RequestTimer
    stage_watch: StageWatch
    tracer: Tracer | None = None
    recheck_stages: Callable[[], Awaitable[None]] | None = None
    """Look at the stages' heartbeats again now (a replica may have beaten since)."""
    begin_trace: Callable[[str], None] | None = None
    """A request flagged `trace` arrived: stamp it from here on (`observe/on_demand.py`)."""
    traced: set[str] | frozenset[str] = frozenset()
    """The requests traced on demand: their stage inputs carry the flag."""
