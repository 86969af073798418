"""What a process shell starts for observability, in one call, and stops in one call.

From its settings: the `/metrics` endpoint (`OMNI_METRICS_PORT`), the tracer
(`OMNI_TRACE_FILE`, `OMNI_TRACE`, OpenTelemetry from `OTEL_EXPORTER_OTLP_ENDPOINT`)
and the stats poller (stream gauges in the orchestrator; every process's
latency summary in `<ns>:stats:<role>` for `omni-runtime status`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.on_demand import LazyRedisTracer
from omni_runtime.observe.poller import StreamStatsPoller
from omni_runtime.observe.probes import Probes
from omni_runtime.observe.tracing import Closable, FanOutTracer, FileTracer, RedisTracer, Tracer
from omni_runtime.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class Observability:
    """The running pieces; `close()` flushes traces and stops every thread and server."""

    metrics: Metrics
    tracer: Tracer | None
    on_demand: Tracer | None = None
    """Stamps the requests traced on demand when `tracer` does not write to Redis already
    (`observe.on_demand`); started by its first stamp."""
    _stops: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Stop every piece, the last started first; one that fails (a trace file or Redis
        that cannot take the last stamps) is reported, and the rest still stop."""
        for stop in reversed(self._stops):
            try:
                stop()
            except (OSError, ValueError, RedisError) as e:
                log.warning("stopping %r failed: %r", stop, e)
        self._stops.clear()


def start_observability(
    settings: Settings,
    metrics: Metrics,
    role: str,
    redis_client: Callable[[], Any] | None = None,
    poll_streams: bool = False,
    poll_interval_s: float | None = None,
    const_labels: dict[str, str] | None = None,
    probes: Probes | None = None,
) -> Observability:
    """Start what `settings` asks for; `role` is "orchestrator", "stage:<k>:<worker>" or "client".

    `redis_client` is a factory of sync clients (`RedisClients.sync`); each
    background thread gets its own. Without it, only the file tracer and the
    metrics endpoint run. `probes` answer `/health` and `/ready` beside `/metrics`;
    `poll_interval_s` defaults to `settings.stats_interval_s`.
    """
    labels = {"role": role.split(":", 1)[0], **(const_labels or {})}
    obs = Observability(metrics, None)
    if settings.metrics_port > 0:  # prometheus_client (~0.1 s to import) only when asked for
        from omni_runtime.observe.prometheus import maybe_start_metrics_server

        obs._stops.append(
            maybe_start_metrics_server(metrics, settings.metrics_port, labels, probes)
        )
    started = False
    try:
        obs.tracer = tracer_for(
            settings.trace_file,
            settings.trace,
            redis_client,
            settings.names,
            settings.trace_ttl_s,
            role,
        )
        if isinstance(obs.tracer, Closable):
            obs._stops.append(obs.tracer.close)
        if redis_client is not None and not settings.trace:
            on_demand = LazyRedisTracer(redis_client, settings.names, settings.trace_ttl_s)
            obs.on_demand = on_demand
            obs._stops.append(on_demand.close)
        if redis_client is not None:
            interval_s = poll_interval_s or settings.stats_interval_s
            poller = StreamStatsPoller(
                redis_client(), settings.names, metrics, role, interval_s, poll_streams, settings
            )
            poller.start()
            obs._stops.append(poller.stop)
        started = True
    finally:
        if not started:  # nothing half started is left running
            obs.close()
    return obs


def tracer_for(
    trace_file: Path | None,
    trace: bool = False,
    redis_client: Callable[[], Any] | None = None,
    names: keys.Names | None = None,
    ttl_s: int = 3600,
    role: str = "omni",
) -> Tracer | None:
    """The tracer a process shell builds from its settings (None: tracing off).

    `trace_file`: a `FileTracer`; `trace` (with a client factory and names): a
    `RedisTracer`; and, when opentelemetry-sdk is installed and
    OTEL_EXPORTER_OTLP_ENDPOINT is set, an `observe.otel.OtelTracer` whose spans
    are named after `role` ("orchestrator", "stage 1", "client").
    """
    tracers: list[Tracer] = []
    if trace_file is not None:
        tracers.append(FileTracer(trace_file))
    if trace and redis_client is not None and names is not None:
        tracers.append(RedisTracer(redis_client(), names, ttl_s).start())
    if trace and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        try:
            from omni_runtime.observe.otel import otel_tracer_from_env
        except ImportError:
            log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry is not installed")
        else:
            otel = otel_tracer_from_env(role)
            if otel is not None:
                tracers.append(otel)
    if not tracers:
        return None
    return tracers[0] if len(tracers) == 1 else FanOutTracer(tracers)
