"""Request timelines as OpenTelemetry spans (optional: `pip install 'omni-runtime[observe]'`).

Every process that stamps a request emits one span for it, named after the
process's role, with the stamps as span events. All spans of one request share
a trace id derived from the request id, so a tracing backend joins the spans of
the orchestrator and of every worker without any context travelling in
messages. `export_stamps` sends a whole timeline read back from Redis instead:
one request span and one child span per stage.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from omni_runtime import keys
from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised
from omni_runtime.observe.tracing import Flushable, Stamp, wall_ns

log = logging.getLogger(__name__)

INSTRUMENTATION = "omni_runtime"


def request_context(request_id: str) -> Any:
    """A remote parent context whose trace id is a hash of the request id."""
    digest = hashlib.sha256(request_id.encode()).digest()
    parent = SpanContext(
        trace_id=int.from_bytes(digest[:16], "big") or 1,
        span_id=int.from_bytes(digest[16:24], "big") or 1,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(NonRecordingSpan(parent))


def _emit(tracer: Any, name: str, request_id: str, stamps: Sequence[Stamp], context: Any) -> Any:
    span = tracer.start_span(
        name,
        context=context,
        start_time=stamps[0][3],
        attributes={"omni.request_id": request_id},
    )
    for event, _rid, stage, t in stamps:
        span.add_event(event, {} if stage is None else {"omni.stage_id": stage}, timestamp=t)
    span.end(end_time=stamps[-1][3])
    return span


def export_stamps(tracer_provider: Any, request_id: str, stamps: Sequence[Stamp]) -> None:
    """One `omni.request` span over the whole timeline (wall-clock ns), a child per stage."""
    if not stamps:
        return
    stamps = sorted(stamps, key=lambda s: s[3])
    tracer = tracer_provider.get_tracer(INSTRUMENTATION)
    root = _emit(tracer, "omni.request", request_id, stamps, request_context(request_id))
    child_context = trace.set_span_in_context(root)
    for stage in sorted({s[2] for s in stamps if s[2] is not None}):
        of_stage = [s for s in stamps if s[2] == stage]
        _emit(tracer, f"omni.stage {stage}", request_id, of_stage, child_context)


class OtelTracer:
    """A `Tracer` that emits one span per request once it has been quiet for `idle_s`.

    Stamps wait in memory, bounded by `max_requests` (the oldest request is
    emitted early) and `keys.TRACE_MAX_EVENTS` per request; a daemon thread emits.
    """

    def __init__(
        self,
        tracer_provider: Any,
        role: str = "omni",
        idle_s: float = 2.0,
        max_requests: int = 10_000,
    ) -> None:
        self.provider = tracer_provider
        self._tracer = tracer_provider.get_tracer(INSTRUMENTATION)
        self.role, self.idle_s, self.max_requests = role, idle_s, max_requests
        self._lock = threading.Lock()
        self._open: OrderedDict[str, tuple[float, list[Stamp]]] = OrderedDict()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otel-tracer", daemon=True)

    def start(self) -> OtelTracer:
        """Start the emitting thread; the tracer itself, for `OtelTracer(...).start()`."""
        self._thread.start()
        return self

    def stamp(
        self, event: str, request_id: str, stage_id: int | None = None, t_ns: int | None = None
    ) -> None:
        stamp = (event, request_id, stage_id, wall_ns(t_ns))
        evicted = None
        with self._lock:
            entry = self._open.pop(request_id, None)
            stamps = entry[1] if entry else []
            if len(stamps) < keys.TRACE_MAX_EVENTS:
                stamps.append(stamp)
            self._open[request_id] = (time.monotonic(), stamps)
            if len(self._open) > self.max_requests:
                evicted = self._open.popitem(last=False)
        if evicted is not None:
            self._send(evicted[0], evicted[1][1])

    def flush(self, idle_s: float | None = None) -> None:
        """Emit every request quiet for `idle_s` (None: every request)."""
        now = time.monotonic()
        with self._lock:
            due = [rid for rid, (t, _) in self._open.items() if idle_s is None or now - t >= idle_s]
            batch = [(rid, self._open.pop(rid)[1]) for rid in due]
        for rid, stamps in batch:
            self._send(rid, stamps)

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(5)
        self.flush()
        if isinstance(self.provider, Flushable):
            self.provider.force_flush()

    def _send(self, request_id: str, stamps: list[Stamp]) -> None:
        sent = foreign.call(  # OpenTelemetry's SDK and the span processors configured in it
            _emit, self._tracer, self.role, request_id, stamps, request_context(request_id)
        )
        if isinstance(sent, Raised):  # an exporter problem must not reach the runtime
            log.warning(
                "exporting the trace of %r failed: %r",
                request_id,
                sent.error,
                extra={"request_id": request_id},
            )

    def _run(self) -> None:
        while not self._stop.wait(self.idle_s / 2):
            self.flush(self.idle_s)


def otel_tracer_from_env(role: str = "omni") -> OtelTracer | None:
    """An OTLP-exporting tracer when OTEL_EXPORTER_OTLP_ENDPOINT is set, else None."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but omni-runtime[observe] is not installed")
        return None
    service = os.environ.get("OTEL_SERVICE_NAME", "omni-runtime")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return OtelTracer(provider, role).start()
