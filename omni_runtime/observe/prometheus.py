"""Expose one process's `Metrics` to Prometheus, through prometheus_client.

`MetricsCollector` turns a registry's snapshot into metric families at each
scrape (nothing is mirrored, so the hot path stays a dict update under a lock).
`start_metrics_server` serves `/metrics` from a daemon thread; `metrics_asgi_app`
and `metrics_wsgi_app` mount the same on an HTTP server.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, make_asgi_app, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from omni_runtime.observe.metrics import COUNTERS, GAUGES, HISTOGRAMS, LabelKey, Metrics
from omni_runtime.observe.probes import Probes, probes_app, serve_wsgi

log = logging.getLogger(__name__)


def _label_names(keys: Iterable[LabelKey], extra: Mapping[str, str]) -> list[str]:
    """Every label any series of the family has: Prometheus wants one set per family."""
    names = {k for key in keys for k, _ in key}
    return sorted(names | set(extra))


def _values(key: LabelKey, names: list[str], extra: Mapping[str, str]) -> list[str]:
    given = {**extra, **dict(key)}
    return [given.get(n, "") for n in names]  # an empty label is an absent one


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class MetricsCollector(Collector):
    """A prometheus_client collector over a `Metrics` registry.

    `const_labels` (e.g. `{"process": "worker", "stage": "1"}`) are added to every
    series, unless the series already carries that label.
    """

    def __init__(self, metrics: Metrics, const_labels: Mapping[str, str] | None = None) -> None:
        self.metrics = metrics
        self.const_labels = dict(const_labels or {})

    def describe(self) -> list[Metric]:
        return []  # label sets are only known at collect time; skip the registration check

    def collect(self) -> Iterator[Metric]:
        extra = self.const_labels
        counters = self.metrics.snapshot()
        for name, help_text in COUNTERS.items():
            series = counters.get(name)
            if not series:
                continue
            names = _label_names(series, extra)
            counter = CounterMetricFamily(name, help_text, labels=names)
            for key, value in sorted(series.items()):
                counter.add_metric(_values(key, names, extra), value)
            yield counter
        gauges = self.metrics.gauges()
        for name, help_text in GAUGES.items():
            series = gauges.get(name)
            if not series:
                continue
            names = _label_names(series, extra)
            gauge = GaugeMetricFamily(name, help_text, labels=names)
            for key, value in sorted(series.items()):
                gauge.add_metric(_values(key, names, extra), value)
            yield gauge
        hists = self.metrics.histograms()
        for name, spec in HISTOGRAMS.items():
            hseries = hists.get(name)
            if not hseries:
                continue
            names = _label_names(hseries, extra)
            family = HistogramMetricFamily(name, spec.help, labels=names)
            for key, h in sorted(hseries.items()):
                buckets = [(_le(bound), float(n)) for bound, n in h.cumulative()]
                family.add_metric(_values(key, names, extra), buckets, h.sum)
            yield family


def metrics_registry(
    metrics: Metrics, const_labels: Mapping[str, str] | None = None
) -> CollectorRegistry:
    """A private registry holding only our collector (no process/GC collectors twice)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(metrics, const_labels))
    return registry


class MetricsServer:
    """A running `/metrics` endpoint: `.port` is where it listens, calling it stops it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.port: int = server.server_port

    def __call__(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def start_metrics_server(
    metrics: Metrics,
    port: int,
    addr: str = "0.0.0.0",
    const_labels: Mapping[str, str] | None = None,
    probes: Probes | None = None,
) -> MetricsServer:
    """Serve `/metrics` on `addr:port` from a daemon thread (port 0: any free port), and
    `/health` and `/ready` from `probes` (`observe.probes`; without, both always 200)."""
    app = probes_app(probes or Probes(), make_wsgi_app(metrics_registry(metrics, const_labels)))
    server, thread = serve_wsgi(app, port, addr)
    stop = MetricsServer(server, thread)
    log.info("metrics on http://%s:%d/metrics", addr, stop.port)
    return stop


def maybe_start_metrics_server(
    metrics: Metrics,
    port: int,
    const_labels: Mapping[str, str] | None = None,
    probes: Probes | None = None,
) -> Callable[[], None]:
    """What a process shell calls with `settings.metrics_port`: 0 (the default) serves nothing."""
    if port <= 0:
        return lambda: None
    return start_metrics_server(metrics, port, const_labels=const_labels, probes=probes)


def metrics_asgi_app(metrics: Metrics, const_labels: Mapping[str, str] | None = None) -> Any:
    """An ASGI app answering the exposition format, to mount at `/metrics`."""
    return make_asgi_app(registry=metrics_registry(metrics, const_labels))


def metrics_wsgi_app(metrics: Metrics, const_labels: Mapping[str, str] | None = None) -> Any:
    """The WSGI equivalent of `metrics_asgi_app`."""
    return make_wsgi_app(registry=metrics_registry(metrics, const_labels))
