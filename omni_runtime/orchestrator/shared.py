"""What every slot an orchestrator process serves shares, built once by the process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from omni_runtime import keys
from omni_runtime.observe.start import Observability
from omni_runtime.observe.timings import RequestTimer
from omni_runtime.orchestrator.leases import Leases
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.redis_io.backoff import RetrySettings
from omni_runtime.redis_io.liveness import StageWatch
from omni_runtime.redis_io.writer import StreamWriter


@dataclass(frozen=True, slots=True)
class SlotSettings:
    """What the slots, their control guards and the watch read of the settings: taken
    from `Settings` by the process shell (`proc.py`), so that none reaches into it."""

    names: keys.Names
    read_count: int
    block_ms: int
    orchestrator_idle_block_ms: int
    max_message_bytes: int
    deadline_s: float
    max_deadline_s: float
    client_stream_ttl_s: int
    durable_requests: bool
    heartbeat_ttl_s: float
    heartbeat_ttl_ms: int
    retry: RetrySettings


@dataclass
class Shared:
    """What every slot of one process shares: one client, one writer, one lease set."""

    pipeline: PipelineConfig
    settings: SlotSettings
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
