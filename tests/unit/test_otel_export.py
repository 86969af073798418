"""Request timelines as OpenTelemetry spans, checked with the SDK's in-memory exporter."""

from __future__ import annotations

import argparse
import io
import time

import fakeredis
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rich.console import Console

from omni_runtime.observe.otel import OtelTracer, export_stamps
from omni_runtime.observe.tracing import RedisTracer
from omni_runtime.ops.trace_view import add_trace_arguments, run_trace
from omni_runtime.settings import Settings
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


STAMPS = [
    ("client_submitted", "r1", None, 1_000_000_000),
    ("input_read", "r1", 0, 1_002_000_000),
    ("output_read", "r1", 0, 1_005_000_000),
    ("input_read", "r1", 1, 1_006_000_000),
    ("output_read", "r1", 1, 1_009_000_000),
]


def test_export_stamps_makes_a_request_span_and_one_per_stage() -> None:
    provider, exporter = _provider()
    export_stamps(provider, "r1", STAMPS)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"omni.request", "omni.stage 0", "omni.stage 1"}
    root = spans["omni.request"]
    assert (root.start_time, root.end_time) == (1_000_000_000, 1_009_000_000)
    assert [e.name for e in root.events][:2] == ["client_submitted", "input_read"]
    stage1 = spans["omni.stage 1"]
    assert stage1.parent is not None and stage1.parent.span_id == root.context.span_id
    assert (stage1.start_time, stage1.end_time) == (1_006_000_000, 1_009_000_000)
    assert {s.context.trace_id for s in spans.values()} == {root.context.trace_id}


def test_live_tracer_emits_each_request_once_quiet_and_joins_processes() -> None:
    provider, exporter = _provider()
    orchestrator = OtelTracer(provider, "orchestrator", idle_s=0.05).start()
    worker = OtelTracer(provider, "stage 1", idle_s=0.05).start()
    try:
        orchestrator.stamp("request_read", "r2")
        worker.stamp("input_read", "r2", 1, time.monotonic_ns())
        worker.stamp("output_read", "r2", 1)
        wait_until(lambda: len(exporter.get_finished_spans()) == 2)
    finally:
        orchestrator.close()
        worker.close()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert [e.name for e in spans["stage 1"].events] == ["input_read", "output_read"]
    assert spans["orchestrator"].context.trace_id == spans["stage 1"].context.trace_id
    start = spans["stage 1"].start_time
    assert start is not None and abs(start - time.time_ns()) < 60 * 10**9  # wall clock


def test_live_tracer_bounds_open_requests() -> None:
    provider, exporter = _provider()
    tracer = OtelTracer(provider, idle_s=600, max_requests=3).start()
    try:
        for i in range(5):
            tracer.stamp("request_read", f"r{i}")
        assert len(exporter.get_finished_spans()) == 2
    finally:
        tracer.close()
    assert len(exporter.get_finished_spans()) == 5


def test_trace_command_exports_to_a_provider() -> None:
    settings = Settings(redis_url="redis://unused")
    client = fakeredis.FakeRedis()
    tracer = RedisTracer(client, settings.names).start()
    for event, rid, stage, _t in STAMPS:
        tracer.stamp(event, rid, stage)
    assert tracer.flush()
    tracer.close()
    provider, exporter = _provider()
    parser = argparse.ArgumentParser()
    add_trace_arguments(parser)
    args = parser.parse_args(["r1", "--otel"])
    assert run_trace(args, settings, client, Console(file=io.StringIO()), provider) == 0
    assert {s.name for s in exporter.get_finished_spans()} >= {"omni.request", "omni.stage 1"}
