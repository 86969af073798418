"""The benchmarks' front door (`benchmarks.harness.serve.for_deployment`) serves the
deployment it is put before: the realtime benchmark runs on it (a front door that exited
at once, from a module with no entry point, went unseen until the benchmark was run)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from benchmarks.harness.procs import Deployment
from benchmarks.harness.serve import for_deployment
from tests.e2e.serving import ROOT

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]

OMNI = ROOT / "workers" / "omni.yaml"
KEY = "test-key-0123456789"


def test_the_benchmarks_front_door_answers_for_its_deployment(
    redis_url: str, tmp_path: Path
) -> None:
    d = Deployment(redis_url, OMNI, "serve", mode="streaming")
    serve = for_deployment(d, OMNI, tmp_path, {"OMNI_API_KEYS": KEY})
    try:
        d.start()
        asyncio.run(d.wait_ready())
        serve.start()
        body = {"model": "omni", "messages": [{"role": "user", "content": "hi"}]}
        got = httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=60,
                         headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
        assert got.status_code == 200, serve.log()
        assert got.json()["choices"][0]["message"]["content"]
        serve.check_alive()
    finally:
        serve.stop()
        d.stop()
