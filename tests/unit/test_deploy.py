"""deploy/: the Grafana dashboard charts only declared metrics, and charts all of them;
the Prometheus config scrapes each process kind on its metrics port."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from omni_runtime.observe.metrics import COUNTERS, GAUGES, HISTOGRAMS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRICS_PORT = 9400
SERVE_PORT = 8000


def _exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    panels: list[dict[str, Any]] = dash["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_dashboard_uses_declared_metrics_only_and_every_one() -> None:
    used = set()
    for expr in _exprs():
        for name in re.findall(r"\bomni_[a-z0-9_]+", expr):
            used.add(re.sub(r"_(bucket|sum|count)$", "", name))
    declared = set(COUNTERS) | set(GAUGES) | set(HISTOGRAMS)
    assert used <= declared, f"undeclared: {sorted(used - declared)}"
    assert declared <= used, f"not charted: {sorted(declared - used)}"


def test_dashboard_histogram_queries_go_through_buckets() -> None:
    for expr in _exprs():
        if "histogram_quantile" in expr:
            assert "_bucket" in expr and "by (le" in expr


def test_prometheus_scrapes_every_process_kind() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert {"omni-orchestrator", "omni-worker", "omni-serve"} <= set(jobs)
    ports = {
        n: sd["port"]
        for j in jobs.values()
        for sd in j.get("dns_sd_configs", [])
        for n in sd["names"]
    }
    assert set(ports) == {"orchestrator", "thinker", "talker", "code2wav", "serve"}
    # serve answers /metrics on its HTTP port; every other process on OMNI_METRICS_PORT
    assert ports.pop("serve") == SERVE_PORT
    assert set(ports.values()) == {METRICS_PORT}
    for path in ("datasources.yml", "dashboards.yml"):
        assert yaml.safe_load((DEPLOY / "grafana" / path).read_text())["apiVersion"] == 1
