"""Observability of a real deployment: every process's /metrics, `status`, and `trace`.

The orchestrator and each worker of `workers/omni.yaml` run as OS processes, each
serving Prometheus on a port of its own, all with `OMNI_TRACE=1`; 100 requests go
through an `OmniClient`. Then each process is scraped and its exposition parsed
with prometheus_client's parser, and `omni-runtime status` and `omni-runtime trace`
run as the operator would run them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_runtime.client.client import OmniClient
from omni_runtime.core.types import OrchOutput
from omni_runtime.local.launcher import child_env, free_port
from omni_runtime.pipeline import load_pipeline
from omni_runtime.settings import Settings
from tests.e2e.serving import ROOT
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]

OMNI = ROOT / "workers" / "omni.yaml"
N_REQUESTS = 100
CONCURRENCY = 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class Proc:
    name: str
    stage: int | None
    metrics_port: int
    popen: subprocess.Popen[bytes]
    log: IO[bytes]
    log_path: Path


class Deployment:
    """The orchestrator and one worker per stage, each with its own OMNI_METRICS_PORT."""

    def __init__(self, redis_url: str, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.pipeline = load_pipeline(OMNI)
        self.namespace = f"o{uuid.uuid4().hex[:8]}"
        self.env = child_env(redis_url, {"OMNI_NAMESPACE": self.namespace, "OMNI_TRACE": "1"})
        self.settings = Settings(
            redis_url=redis_url, namespace=self.namespace, trace=True, block_ms=50
        )
        self.procs: list[Proc] = []

    def start(self) -> None:
        cli = [sys.executable, "-m", "omni_runtime.cli"]
        common = ["--pipeline", str(OMNI)]
        self._spawn("orchestrator", None, [*cli, "orchestrator", *common])
        for stage in self.pipeline.stages:
            for r in range(stage.replicas):
                cmd = [*cli, "worker", *common, "--stage", str(stage.id)]
                self._spawn(f"stage{stage.id}-{r}", stage.id, cmd)

    def _spawn(self, name: str, stage: int | None, cmd: list[str]) -> None:
        port = free_port()
        log_path = self.tmp_path / f"{name}.log"
        log = log_path.open("wb")
        env = {**self.env, "OMNI_METRICS_PORT": str(port)}
        popen = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(Proc(name, stage, port, popen, log, log_path))

    def stop(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.terminate()
        for p in self.procs:
            try:
                p.popen.wait(15)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
            p.log.close()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.log_path.read_text(errors='replace')[-2000:]}" for p in self.procs
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`omni-runtime ARGS` against this deployment's Redis and namespace."""
        return subprocess.run(
            [sys.executable, "-m", "omni_runtime.cli", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def scrape(self, proc: Proc) -> dict[str, Any]:
        """The process's metric families by name (counters without their `_total`)."""
        url = f"http://127.0.0.1:{proc.metrics_port}/metrics"
        end = time.monotonic() + 30
        while True:
            assert proc.popen.poll() is None, f"{proc.name} exited:\n{self.logs()}"
            try:
                resp = httpx.get(url, timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < end, f"nothing serves {url}"
                time.sleep(0.1)
        assert resp.status_code == 200, resp.text
        return {f.name: f for f in text_string_to_metric_families(resp.text)}


async def run_requests(settings: Settings, stage_ids: list[int]) -> dict[str, list[OrchOutput]]:
    async with OmniClient(settings) as client:
        await client.wait_ready(stage_ids, timeout_s=60)
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(i: int) -> tuple[str, list[OrchOutput]]:
            rid = f"obs-{i:03d}"
            async with gate:
                outs = [o async for o in client.generate(f"Hello number {i}!", request_id=rid)]
            return rid, outs

        return dict(await asyncio.gather(*(one(i) for i in range(N_REQUESTS))))


@pytest.fixture(scope="module")
def deployment(
    redis_server_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """A deployment that has served exactly N_REQUESTS requests, every one complete."""
    dep = Deployment(redis_server_url, tmp_path_factory.mktemp("observability"))
    dep.start()
    try:
        stage_ids = [s.id for s in dep.pipeline.stages]
        results = asyncio.run(run_requests(dep.settings, stage_ids))
        assert len(results) == N_REQUESTS
        for rid, outs in results.items():
            assert outs and outs[-1].finished, rid
            assert all(o.error is None for o in outs), (rid, [o.error for o in outs])
            assert {o.stage_id for o in outs} == {0, 2}, rid
        yield dep
    finally:
        dep.stop()


def _sample(family: Any, suffix: str) -> float:
    """The one sample of `family` named `<family><suffix>`."""
    (sample,) = [s for s in family.samples if s.name == family.name + suffix]
    return float(sample.value)


def test_every_process_exports_its_series(deployment: Deployment) -> None:
    orchestrator, *workers = deployment.procs
    families = deployment.scrape(orchestrator)
    for name in (
        "omni_time_to_first_token_seconds",
        "omni_time_to_first_audio_seconds",
        "omni_e2e_request_latency_seconds",
    ):
        assert _sample(families[name], "_count") == N_REQUESTS, name
        assert families[name].samples[0].labels["role"] == "orchestrator"
    assert _sample(families["omni_requests_received"], "_total") == N_REQUESTS
    assert _sample(families["omni_requests_running"], "") == 0  # all of them ended
    for proc in workers:
        families = deployment.scrape(proc)
        outputs = families["omni_stage_outputs"]
        (sample,) = outputs.samples
        assert sample.labels == {"role": "stage", "stage": str(proc.stage)}
        assert sample.value >= N_REQUESTS, proc.name  # at least the final one per request
        run_time = families["omni_stage_run_time_seconds"]
        assert _sample(run_time, "_count") == N_REQUESTS, proc.name  # one replica per stage
        assert _sample(families["omni_stage_queue_time_seconds"], "_count") >= N_REQUESTS


def test_status_lists_every_process_and_stream(deployment: Deployment) -> None:
    def snapshot() -> dict[str, Any]:
        done = deployment.cli("status", "--once", "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        return dict(json.loads(done.stdout))

    def own_beat(snap: dict[str, Any]) -> dict[str, Any]:
        (orch,) = [p for p in snap["processes"] if p["kind"] == "orchestrator" and p["name"]]
        return dict(orch)

    # an orchestrator's own beat says what it had done at its last beat (once a second)
    wait_until(lambda: (own_beat(snapshot())["completed"] or 0) >= N_REQUESTS, 10)
    snap = snapshot()
    names = deployment.settings.names
    assert snap["namespace"] == deployment.namespace
    assert snap["orchestrators"] == 1
    assert snap["workers_per_stage"] == {"0": 1, "1": 1, "2": 1}
    workers = {p["pid"]: p["stage"] for p in snap["processes"] if p["kind"] == "worker"}
    assert workers == {p.popen.pid: p.stage for p in deployment.procs if p.stage is not None}
    assert snap["pipeline"] == {"name": deployment.pipeline.name, "mode": "streaming"}
    orch = own_beat(snap)
    orchestrator = deployment.procs[0]
    assert (orch["pid"], orchestrator.stage) == (orchestrator.popen.pid, None)
    assert orch["host"] and orch["uptime_s"] > 0 and orch["completed"] >= N_REQUESTS
    assert not any(p["name"] == "epoch" or p["kind"] == "epoch" for p in snap["processes"])
    streams = {s["name"] for s in snap["streams"]}
    for sid in (0, 1, 2):
        assert {names.stage_in(sid), names.stage_out(sid)} <= streams
    assert names.requests in streams


def test_trace_shows_every_process_and_draws_a_png(deployment: Deployment) -> None:
    rid = "obs-007"
    wanted = {
        ("client_submitted", None),  # the client
        ("request_read", None),  # the orchestrator
        *(("input_read", sid) for sid in (0, 1, 2)),  # each worker
    }
    end = time.monotonic() + 10  # tracers write their stamps in the background
    while True:
        done = deployment.cli("trace", rid, "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        seen = {(row["event"], row["stage"]) for row in json.loads(done.stdout)}
        if wanted <= seen or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert wanted <= seen, sorted(seen, key=str)
    png = deployment.tmp_path / "t.png"
    done = deployment.cli("trace", rid, "--png", str(png))
    assert done.returncode == 0, done.stdout + done.stderr
    for text in (f"request {rid}", "client_submitted", "request_read", "input_read", "stage 2"):
        assert text in done.stdout, (text, done.stdout)
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 1000 and height >= 300, (width, height)
    assert len(data) > 20_000
