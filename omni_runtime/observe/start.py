"""A process's observability: one object, built by its shell, handed whole to its parts.

`Observability` holds the metrics registry and the tracers. A process shell builds it
with its other parts and passes it to each one that counts or stamps, through its
constructor; its `run` starts it (`start`), and its shutdown closes it (`close`). From the
settings, `start` runs the `/metrics` endpoint (`OMNI_METRICS_PORT`), the tracer
(`OMNI_TRACE_FILE`, `OMNI_TRACE`, OpenTelemetry from `OTEL_EXPORTER_OTLP_ENDPOINT`), the
tracer of requests traced on demand, and the stats poller (stream gauges in the
orchestrator; every process's latency summary in `<ns>:stats:<role>` for
`omni-runtime status`).

A part reads `obs.tracer` at each stamp and never keeps it: the router switches it while
requests traced on demand are in flight (`begin_trace`, `observe/on_demand.py`), and
every part stamps through the new one without being told.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.on_demand import LazyRedisTracer, OnDemandTracer
from omni_runtime.observe.poller import StreamStatsPoller
from omni_runtime.observe.probes import Probes
from omni_runtime.observe.tracing import Closable, FanOutTracer, FileTracer, RedisTracer, Tracer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ObserveSettings:
    """What `Observability.start` reads of the settings, taken from `Settings` by the
    process shell."""

    names: keys.Names
    metrics_port: int
    trace_file: Path | None
    trace: bool
    trace_ttl_s: int
    stats_interval_s: float
    worker_max_concurrency: int
    """A worker's slots when its heartbeat does not say (the stats poller's capacity)."""
    scale_target_per_replica: int | None


class Observability:
    """Metrics and tracers of one process; nothing runs until `start`."""

    def __init__(
        self,
        metrics: Metrics | None = None,
        tracer: Tracer | None = None,
        on_demand: Tracer | None = None,
    ) -> None:
        self.metrics = metrics or Metrics()
        self.tracer = tracer
        """The tracer of the moment (None: tracing off): read at each stamp, never kept."""
        self.on_demand = on_demand
        """Stamps a request whose message carries the `trace` flag, when `tracer` does not
        write to Redis already (`observe.on_demand`); started by its first stamp."""
        self.traced: set[str] = set()
        """The router's requests traced on demand, in flight: their stage inputs carry the
        flag to the workers."""
        self._base = tracer
        self._router: OnDemandTracer | None = None
        self._stops: list[Callable[[], None]] = []

    def start(
        self,
        settings: ObserveSettings,
        role: str,
        redis_client: Callable[[], Any] | None = None,
        *,
        serve: bool = True,
        poll_streams: bool = False,
        poll_interval_s: float | None = None,
        const_labels: dict[str, str] | None = None,
        probes: Probes | None = None,
    ) -> Observability:
        """Start what `settings` asks for; `role` is "orchestrator", "stage:<k>:<worker>"
        or "client".

        `redis_client` is a factory of sync clients (`RedisClients.sync`); each background
        thread gets its own. Without it, only the file tracer and the metrics endpoint
        run. `serve`: the metrics endpoint (with `probes` answering `/health` and `/ready`
        beside `/metrics`) and the stats poller, which a client inside another process
        leaves to that process; `poll_interval_s` defaults to `settings.stats_interval_s`.
        """
        labels = {"role": role.split(":", 1)[0], **(const_labels or {})}
        if (
            serve and settings.metrics_port > 0
        ):  # prometheus_client (~0.1 s to import) only when asked for
            from omni_runtime.observe.prometheus import maybe_start_metrics_server

            self._stops.append(
                maybe_start_metrics_server(self.metrics, settings.metrics_port, labels, probes)
            )
        started = False
        try:
            self.tracer = self._base = tracer_for(
                settings.trace_file,
                settings.trace,
                redis_client,
                settings.names,
                settings.trace_ttl_s,
                role,
            )
            if isinstance(self.tracer, Closable):
                self._stops.append(self.tracer.close)
            if redis_client is not None and not settings.trace:
                on_demand = LazyRedisTracer(redis_client, settings.names, settings.trace_ttl_s)
                self.on_demand = on_demand
                self._stops.append(on_demand.close)
                self._router = OnDemandTracer(on_demand, self._untrace, self.traced)
            if serve and redis_client is not None:
                interval_s = poll_interval_s or settings.stats_interval_s
                client = redis_client()
                self._stops.append(client.close)  # after the poller's stop: reversed order
                poller = StreamStatsPoller(
                    client,
                    settings.names,
                    self.metrics,
                    role,
                    interval_s,
                    poll_streams,
                    default_concurrency=settings.worker_max_concurrency,
                    target=settings.scale_target_per_replica,
                )
                poller.start()
                self._stops.append(poller.stop)
            started = True
        finally:
            if not started:  # nothing half started is left running
                self.close()
        return self

    def begin_trace(self, request_id: str) -> None:
        """The router read a request flagged `trace`: every part of this process stamps it
        from now to its end (`FINISHED`), while requests not traced cost what they cost
        with tracing off. A process-wide tracer stamps every request already."""
        router = self._router
        if router is None or self._base is not None:
            return
        if not self.traced:
            self.tracer = router
        self.traced.add(request_id)

    def _untrace(self) -> None:
        """The last request traced on demand ended: back to no tracer."""
        self.tracer = self._base

    def close(self) -> None:
        """Stop every piece, the last started first; one that fails (a trace file or Redis
        that cannot take the last stamps) is reported, and the rest still stop."""
        for stop in reversed(self._stops):
            try:
                stop()
            except (OSError, ValueError, RedisError) as e:
                log.warning("stopping %r failed: %r", stop, e)
        self._stops.clear()


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
        tracers.append(RedisTracer(redis_client(), names, ttl_s, close_client=True).start())
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
