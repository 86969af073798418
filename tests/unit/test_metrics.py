"""The metrics registry: counters, histograms, gauges, and their Prometheus export."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_runtime.observe.metrics import COUNTERS, GAUGES, HISTOGRAMS, Metrics
from omni_runtime.observe.probes import Probes
from omni_runtime.observe.prometheus import (
    MetricsCollector,
    maybe_start_metrics_server,
    metrics_wsgi_app,
    start_metrics_server,
)


def test_names_follow_the_conventions() -> None:
    assert all(n.startswith("omni_") and n.endswith("_total") for n in COUNTERS)
    assert all(n.startswith("omni_") and n.endswith("_seconds") for n in HISTOGRAMS)
    assert all(n.startswith("omni_") and not n.endswith("_total") for n in GAUGES)
    for spec in HISTOGRAMS.values():
        assert list(spec.buckets) == sorted(set(spec.buckets))


def test_histogram_buckets_sum_count_and_quantiles() -> None:
    m = Metrics()
    for v in (0.001, 0.002, 0.3, 1000.0):
        m.observe("omni_e2e_request_latency_seconds", v)
    h = m.histogram("omni_e2e_request_latency_seconds")
    assert h.count == 4 and h.sum == pytest.approx(1000.303)
    cum = dict(h.cumulative())
    assert cum[0.001] == 1  # upper bounds are inclusive, as Prometheus' `le`
    assert cum[0.0025] == 2 and cum[0.5] == 3 and cum[float("inf")] == 4
    q50 = h.quantile(0.5)
    assert q50 is not None and 0.001 <= q50 <= 0.0025
    assert m.histogram("omni_audio_gap_seconds").quantile(0.5) is None


def test_histograms_merge_over_labels() -> None:
    m = Metrics()
    m.observe("omni_stage_run_time_seconds", 0.1, stage=0)
    m.observe("omni_stage_run_time_seconds", 0.2, stage=1)
    assert m.histogram("omni_stage_run_time_seconds").count == 2
    assert m.histogram("omni_stage_run_time_seconds", stage=1).count == 1


def test_undeclared_names_are_refused() -> None:
    m = Metrics()
    with pytest.raises(KeyError):
        m.observe("omni_nope_seconds", 1)
    with pytest.raises(KeyError):
        m.set_gauge("omni_nope", 1)
    with pytest.raises(KeyError):
        m.inc("omni_nope_total")


def test_gauges_set_add_callbacks_and_removal() -> None:
    m = Metrics()
    m.set_gauge("omni_stream_length", 7, stream="a")
    m.set_gauge("omni_stream_length", 3, stream="b")
    m.add_gauge("omni_stage_inputs_in_flight", 2, stage=1)
    m.add_gauge("omni_stage_inputs_in_flight", -1, stage=1)
    level = [5.0]
    unregister = m.gauge_callback("omni_requests_running", lambda: level[0])
    m.gauge_callback("omni_workers_alive", lambda: 1 / 0, stage=0)  # logged, skipped
    assert m.gauge("omni_stream_length", stream="a") == 7
    assert m.gauge("omni_stage_inputs_in_flight", stage=1) == 1
    level[0] = 6
    assert m.gauge("omni_requests_running") == 6
    assert m.gauge("omni_workers_alive", stage=0) is None
    unregister()
    assert m.gauge("omni_requests_running") is None
    m.remove_gauges("omni_stream_length", keep=[(("stream", "b"),)])
    assert m.gauges()["omni_stream_length"] == {(("stream", "b"),): 3}


def test_concurrent_updates_are_not_lost() -> None:
    m = Metrics()

    def work() -> None:
        for _ in range(2000):
            m.observe("omni_audio_gap_seconds", 0.01)
            m.inc("omni_takeovers_total")
            m.add_gauge("omni_stage_inputs_in_flight", 1, stage=0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.histogram("omni_audio_gap_seconds").count == 8000
    assert m.value("omni_takeovers_total") == 8000
    assert m.gauge("omni_stage_inputs_in_flight", stage=0) == 8000


def _families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    return {
        f.name: [(s.name, s.labels, s.value) for s in f.samples]
        for f in text_string_to_metric_families(text)
    }


def _filled() -> Metrics:
    m = Metrics()
    m.inc("omni_aborts_total", reason="deadline exceeded")
    m.inc("omni_aborts_total", 2, reason="client went away")
    m.inc("omni_dead_letters_total")
    m.observe("omni_time_to_first_audio_seconds", 0.04)
    m.observe("omni_chunk_handoff_latency_seconds", 0.0007, stage=2)
    m.set_gauge("omni_stream_pending_entries", 4, stream="omni:stage:1:in", group="workers")
    return m


def test_scraped_over_http_and_parsed_by_prometheus_client() -> None:
    stop = start_metrics_server(_filled(), 0, "127.0.0.1", {"process": "worker", "stage": "9"})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{stop.port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        stop()
    fams = _families(text)
    aborts = {s[1]["reason"]: s[2] for s in fams["omni_aborts"] if s[0] == "omni_aborts_total"}
    assert aborts == {"deadline exceeded": 1, "client went away": 2}
    assert all(s[1]["process"] == "worker" for s in fams["omni_aborts"])
    ttfa = {
        s[0]: s[2]
        for s in fams["omni_time_to_first_audio_seconds"]
        if s[1].get("le") in (None, "+Inf")
    }
    assert ttfa["omni_time_to_first_audio_seconds_count"] == 1
    assert ttfa["omni_time_to_first_audio_seconds_sum"] == pytest.approx(0.04)
    handoff = fams["omni_chunk_handoff_latency_seconds"]
    assert {s[1]["stage"] for s in handoff} == {"2"}  # the series' own label wins
    (pending,) = fams["omni_stream_pending_entries"]
    assert pending[1]["group"] == "workers" and pending[2] == 4


def test_wsgi_app_and_collector_without_http() -> None:
    m = _filled()
    assert {f.name for f in MetricsCollector(m).collect()} >= {"omni_aborts", "omni_dead_letters"}
    status: list[str] = []
    body = b"".join(
        metrics_wsgi_app(m)(
            {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "QUERY_STRING": ""},
            lambda s, _h: status.append(s),
        )
    )
    assert status[0].startswith("200")
    assert "omni_dead_letters" in _families(body.decode())


def test_port_zero_setting_serves_nothing() -> None:
    stop = maybe_start_metrics_server(Metrics(), 0)
    stop()  # a no-op


async def test_asgi_app_answers_the_exposition_format() -> None:
    from omni_runtime.observe.prometheus import metrics_asgi_app

    app = metrics_asgi_app(_filled())
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/metrics",
        "query_string": b"",
        "headers": [],
    }
    await app(scope, receive, send)
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:])  # type: ignore[misc]
    assert "omni_dead_letters" in _families(body.decode())


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_health_and_ready_beside_metrics() -> None:
    why: list[str | None] = ["starting"]
    stop = start_metrics_server(Metrics(), 0, "127.0.0.1", probes=Probes(ready=lambda: why[0]))
    try:
        assert _get(stop.port, "/health") == (200, "ok\n")
        assert _get(stop.port, "/ready") == (503, "starting\n")
        why[0] = None
        assert _get(stop.port, "/ready") == (200, "ok\n")
        why[0] = "draining"
        assert _get(stop.port, "/ready") == (503, "draining\n")
        status, body = _get(stop.port, "/metrics")
        assert (status == 200 and "# HELP" in body) or body == ""
    finally:
        stop()


def test_a_probe_that_raises_is_not_ready() -> None:
    def broken() -> str | None:
        raise RuntimeError("boom")

    stop = start_metrics_server(Metrics(), 0, "127.0.0.1", probes=Probes(ready=broken))
    try:
        status, body = _get(stop.port, "/ready")
        assert status == 503 and "boom" in body
    finally:
        stop()
