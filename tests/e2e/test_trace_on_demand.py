"""One request traced on demand in a deployment whose tracing is off.

The orchestrator and a worker per stage of `workers/omni.yaml` run as OS processes
over a real redis-server, none with `OMNI_TRACE`. A request flagged by the client
(`submit(trace=True)`), by `omni-runtime submit --trace`, or by the `X-Omni-Trace: 1`
header of `serve` gets a timeline with stamps from the client, the orchestrator and a
worker of every stage; a request sent alongside it without the flag gets none.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator

import httpx
import pytest
import redis

from omni_runtime.client.client import OmniClient
from omni_runtime.local.launcher import ProcessGroup, child_env
from omni_runtime.observe.tracing import Stamp, read_redis_trace
from omni_runtime.pipeline import load_pipeline
from omni_runtime.settings import Settings
from tests.e2e.serving import ROOT, ServeProcess

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]

OMNI = ROOT / "workers" / "omni.yaml"
STAGES = range(3)
DEADLINE_S = 30.0


class Deployment:
    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.namespace = f"t{uuid.uuid4().hex[:8]}"
        env = child_env(redis_url, {"OMNI_NAMESPACE": self.namespace})
        for name in ("OMNI_TRACE", "OMNI_TRACE_FILE", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            env.pop(name, None)  # tracing off everywhere
        self.env = env
        self.settings = Settings(redis_url=redis_url, namespace=self.namespace, trace=False)
        self.redis = redis.Redis.from_url(redis_url)

    def stamps(self, request_id: str) -> list[Stamp]:
        return read_redis_trace(self.redis, self.settings.names, request_id)

    def complete(self, request_id: str, stages: Iterable[int] = STAGES) -> bool:
        """Client, orchestrator (read to finished) and a worker of every stage stamped it."""
        seen = {(event, stage) for event, _rid, stage, _t in self.stamps(request_id)}
        wanted: set[tuple[str, int | None]] = {
            ("client_submitted", None),
            ("request_read", None),
            ("request_finished", None),
        }
        wanted |= {("input_submitted", k) for k in stages}  # orchestrator, per stage
        wanted |= {("input_read", k) for k in stages}  # the workers
        return wanted <= seen

    def wait_traced(self, request_id: str, stages: Iterable[int] = STAGES) -> None:
        end = time.monotonic() + DEADLINE_S
        while not self.complete(request_id, stages):
            assert time.monotonic() < end, f"incomplete trace: {self.stamps(request_id)}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def deployment(redis_server_url: str) -> Iterator[Deployment]:
    d = Deployment(redis_server_url)
    group = ProcessGroup(OMNI, load_pipeline(OMNI), d.env)
    group.start()
    try:
        yield d
    finally:
        group.stop()
        d.redis.close()


async def _two_requests(d: Deployment) -> tuple[str, str]:
    """An untraced request, then a traced one while it is in flight; both to the end."""
    async with OmniClient(d.settings) as client:
        await client.wait_ready(list(STAGES))
        plain = await client.submit("hello there")
        traced = await client.submit("hello there", trace=True)

        async def drain(request_id: str) -> None:
            async for out in client.stream(request_id):
                assert out.error is None, out

        await asyncio.gather(drain(plain), drain(traced))
    return plain, traced


def test_a_request_traced_by_the_client_is_stamped_by_every_process(d: Deployment) -> None:
    plain, traced = asyncio.run(_two_requests(d))
    d.wait_traced(traced)
    # The traced request's stamps are all written, in FIFO order per process, after
    # anything the plain one could have left: the plain one has none at all.
    assert d.stamps(plain) == []
    assert d.redis.exists(d.settings.names.trace(plain)) == 0


def test_submit_trace_names_the_request_and_trace_shows_its_timeline(d: Deployment) -> None:
    base = [sys.executable, "-m", "omni_runtime.cli"]
    common = ["--redis-url", d.redis_url, "--namespace", d.namespace]
    run = subprocess.run(
        [*base, "submit", "--pipeline", str(OMNI), *common, "--trace", "hi"],
        cwd=ROOT,
        env=d.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    found = re.search(r"request (\S+) is traced: omni-runtime trace (\S+)", run.stderr)
    assert found is not None and found.group(1) == found.group(2), run.stderr
    request_id = found.group(1)
    d.wait_traced(request_id)
    shown = subprocess.run(
        [*base, "trace", request_id, *common],
        cwd=ROOT,
        env=d.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    for event in ("request_read", "input_read", "request_finished"):
        assert event in shown.stdout, shown.stdout


def test_the_trace_header_traces_one_http_request(
    d: Deployment, tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = ("--pipeline", str(OMNI), "--redis-url", d.redis_url, "--namespace", d.namespace)
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ServeProcess(log, *args) as serve:
        text = {"model": "omni", "messages": [{"role": "user", "content": "hi"}]}
        body = {**text, "modalities": ["text", "audio"], "audio": {"format": "wav", "voice": "x"}}
        url = f"{serve.url}/v1/chat/completions"
        plain = httpx.post(url, json=body, timeout=60)
        traced = httpx.post(url, json=body, headers={"X-Omni-Trace": "1"}, timeout=60)
        text_only = httpx.post(url, json=text, headers={"X-Omni-Trace": "1"}, timeout=60)
        speech = httpx.post(
            f"{serve.url}/v1/audio/speech",
            json={"model": "omni", "input": "hi", "response_format": "pcm"},
            headers={"X-Omni-Trace": "true"},
            timeout=60,
        )
    for response in (plain, traced, speech, text_only):
        assert response.status_code == 200, response.text
    plain_id, traced_id = plain.headers["X-Omni-Request-Id"], traced.headers["X-Omni-Request-Id"]
    assert traced.json()["id"] == f"chatcmpl-{traced_id}"
    d.wait_traced(traced_id)
    d.wait_traced(speech.headers["X-Omni-Request-Id"])
    assert d.stamps(plain_id) == []
    # a text chat runs the thinker alone: the talker and the vocoder are never given it
    text_id = text_only.headers["X-Omni-Request-Id"]
    d.wait_traced(text_id, stages=[0])
    assert {s for event, _rid, s, _t in d.stamps(text_id) if event == "input_submitted"} == {0}


@pytest.fixture
def d(deployment: Deployment) -> Deployment:
    return deployment
