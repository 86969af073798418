"""One call starts a process's observability from its settings; one call stops it."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import fakeredis
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.on_demand import FINISHED
from omni_runtime.observe.prometheus import start_metrics_server
from omni_runtime.observe.start import Observability, ObserveSettings
from omni_runtime.observe.tracing import FanOutTracer, read_redis_trace
from omni_runtime.settings import Settings
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


def test_settings_fields_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_TRACE", "1")
    monkeypatch.setenv("OMNI_METRICS_PORT", "9400")
    monkeypatch.setenv("OMNI_TRACE_TTL_S", "60")
    s = Settings()
    assert (s.trace, s.metrics_port, s.trace_ttl_s) == (True, 9400, 60)
    assert (
        Settings.model_fields["trace"].default,
        Settings.model_fields["metrics_port"].default,
    ) == (
        False,
        0,
    )


def test_everything_off_by_default() -> None:
    obs = Observability().start(
        Settings(redis_url="redis://unused").part(ObserveSettings), "orchestrator"
    )
    assert obs.tracer is None
    obs.close()


def test_tracing_stats_and_metrics_when_asked(tmp_path: Path) -> None:
    server = fakeredis.FakeServer()
    settings = Settings(redis_url="redis://unused", trace=True, trace_file=tmp_path / "t.log")
    metrics = Metrics()
    metrics.observe("omni_e2e_request_latency_seconds", 0.5)
    obs = Observability(metrics).start(
        settings.part(ObserveSettings),
        "orchestrator",
        lambda: fakeredis.FakeRedis(server=server),
        poll_streams=True,
        poll_interval_s=0.05,
    )
    reader = fakeredis.FakeRedis(server=server)
    try:
        assert isinstance(obs.tracer, FanOutTracer)
        obs.tracer.stamp("request_read", "r1")
        wait_until(lambda: reader.get(settings.names.stats("orchestrator")) is not None)
        doc = json.loads(reader.get(settings.names.stats("orchestrator")) or b"{}")
        assert doc["latency"]["omni_e2e_request_latency_seconds"]["count"] == 1
    finally:
        obs.close()  # flushes the trace
    assert [s[0] for s in read_redis_trace(reader, settings.names, "r1")] == ["request_read"]
    assert "request_read r1" in (tmp_path / "t.log").read_text()
    assert reader.get(settings.names.stats("orchestrator")) is None  # a clean exit leaves none


def test_role_label_on_every_series() -> None:
    metrics = Metrics()
    metrics.inc("omni_takeovers_total", stage=1)
    stop = start_metrics_server(metrics, 0, "127.0.0.1", {"role": "stage"})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{stop.port}/metrics", timeout=10) as r:
            fams = list(text_string_to_metric_families(r.read().decode()))
    finally:
        stop()
    (sample,) = [s for f in fams for s in f.samples if s.name == "omni_takeovers_total"]
    assert sample.labels == {"role": "stage", "stage": "1"}


def test_the_router_stamps_a_request_traced_on_demand_from_its_read_to_its_end() -> None:
    """Tracing off: `begin_trace` switches the tracer every part reads to one that stamps
    the traced requests only, and back to none when the last of them finished."""
    server = fakeredis.FakeServer()
    settings = Settings(redis_url="redis://unused")
    obs = Observability().start(
        settings.part(ObserveSettings),
        "orchestrator",
        lambda: fakeredis.FakeRedis(server=server),
        serve=False,
    )
    reader = fakeredis.FakeRedis(server=server)
    try:
        assert obs.tracer is None
        obs.begin_trace("r1")
        assert obs.tracer is not None and obs.traced == {"r1"}
        obs.tracer.stamp("request_read", "r1")
        obs.tracer.stamp("request_read", "r2")  # not traced: not stamped
        obs.tracer.stamp(FINISHED, "r1")
        assert obs.tracer is None and not obs.traced
    finally:
        obs.close()  # flushes the trace
    assert [s[0] for s in read_redis_trace(reader, settings.names, "r1")] == [
        "request_read",
        FINISHED,
    ]
    assert read_redis_trace(reader, settings.names, "r2") == []


def test_a_process_wide_tracer_is_not_switched_for_a_request_traced_on_demand(
    tmp_path: Path,
) -> None:
    settings = Settings(redis_url="redis://unused", trace_file=tmp_path / "t.log")
    obs = Observability().start(
        settings.part(ObserveSettings), "orchestrator", lambda: fakeredis.FakeRedis(), serve=False
    )
    try:
        base = obs.tracer
        assert base is not None
        obs.begin_trace("r1")
        assert obs.tracer is base
    finally:
        obs.close()


def test_the_clients_made_for_its_threads_are_closed_with_it(redis_url: str) -> None:
    """The stats poller, the process-wide tracer and the one started on demand each get a
    client of their own from the factory: `close` closes it, rather than leaving its
    socket open until the garbage collector finds it."""
    admin = redis.Redis.from_url(redis_url)
    name = "obs-own-client"

    def made() -> redis.Redis:
        return redis.Redis.from_url(redis_url, client_name=name)

    def connected() -> int:
        return sum(1 for c in admin.client_list() if c.get("name") == name)

    wide = Settings(redis_url=redis_url, trace=True).part(ObserveSettings)
    quiet = Settings(redis_url=redis_url).part(ObserveSettings)
    try:
        polled = Observability().start(wide, "orchestrator", made, poll_interval_s=0.05)
        on_demand = Observability().start(quiet, "orchestrator", made, serve=False)
        try:
            assert polled.tracer is not None
            polled.tracer.stamp("request_read", "r1")
            on_demand.begin_trace("r2")
            assert on_demand.tracer is not None
            on_demand.tracer.stamp("request_read", "r2")
            wait_until(lambda: connected() == 3, explain=lambda: f"{connected()} connected")
        finally:
            polled.close()
            on_demand.close()
        wait_until(lambda: connected() == 0, explain=lambda: f"{connected()} left open")
    finally:
        admin.close()
