"""What every slot an orchestrator process serves shares, built once by the process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from omni_runtime.observe.start import Observability
from omni_runtime.observe.timings import RequestTimer
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
    obs: Observability
    """The process's metrics and tracer of the moment (`begin_trace` for a request flagged
    `trace`)."""
    timer: RequestTimer
    stage_watch: StageWatch
    recheck_stages: Callable[[], Awaitable[None]] | None = None
    """Look at the stages' heartbeats again now (a replica may have beaten since)."""
    wedge_after: int | None = None
    """A test hook (`proc.TEST_WEDGE_AFTER`): a slot's request loop blocks for good before
    it takes its (N+1)th entry."""
