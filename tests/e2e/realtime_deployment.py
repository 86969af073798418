"""What the `/v1/realtime` tests on the synthetic demo share: the demo (workers/omni.yaml in
streaming mode, as processes) with `serve` in front, and more front doors to it."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import redis

from omni_runtime import keys
from omni_runtime.local.launcher import ProcessGroup, child_env
from omni_runtime.observe.redis_stats import read_heartbeats, server_now
from omni_runtime.pipeline import load_pipeline
from tests.e2e.serving import ROOT, ServeProcess

OMNI = ROOT / "workers" / "omni.yaml"
KEY = "test-key-0123456789"
LONG_TEXT = " ".join(f"word{i}" for i in range(600))
"""~60 s of the demo's audio, its text made over ~12 s: every stage still has it when the
user speaks, even on a busy machine."""


@dataclass(frozen=True)
class StageCounts:
    aborted: int
    ended: int
    """Completed, failed or aborted."""
    in_flight: int


class Deployment:
    def __init__(self, redis_url: str, namespace: str, serve: ServeProcess) -> None:
        self.redis_url, self.namespace, self.serve = redis_url, namespace, serve

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.serve.url}/v1", api_key=KEY, max_retries=0)

    def worker_status(self) -> list[dict[str, Any]]:
        """Every live worker's heartbeat (`status`'s source)."""
        r = redis.Redis.from_url(self.redis_url)
        try:
            now_s, _ = server_now(r)
            beats = [r.get(p.key) for p in read_heartbeats(r, keys.Names(self.namespace), now_s)
                     if p.kind == "worker" and p.stage is not None]  # fmt: skip
        finally:
            r.close()
        return [json.loads(beat) for beat in beats if beat is not None]

    def stage_counts(self) -> dict[int, StageCounts]:
        """Each stage's workers' counts, summed, as their heartbeats say."""
        out: dict[int, StageCounts] = {}
        for doc in self.worker_status():
            ended = doc["completed"] + doc["failed"] + doc["aborted"]
            seen = out.get(doc["stage_id"], StageCounts(0, 0, 0))
            out[doc["stage_id"]] = StageCounts(
                seen.aborted + doc["aborted"], seen.ended + ended, seen.in_flight + doc["in_flight"]
            )
        return out

    def dropped_since(self, before: dict[int, StageCounts], stages: int = 3) -> bool:
        """A request begun after `before` ended at every stage and none runs anything: the
        first stage aborted it, and each later one aborted it or ended it on its upstream's
        cancelled last chunk (a final with data None, which may reach it before its own
        abort does)."""
        now, none = self.stage_counts(), StageCounts(0, 0, 0)
        if any(now.get(s, none).in_flight for s in range(stages)):
            return False
        first_aborted = now.get(0, none).aborted > before.get(0, none).aborted
        return first_aborted and all(
            now.get(s, none).ended > before.get(s, none).ended for s in range(1, stages)
        )

    def explain_stages(self) -> str:
        """What each worker has done, for a failed wait's message."""
        counts = ("in_flight", "completed", "failed", "aborted")
        return "; ".join(f"stage {d['stage_id']}: " + ", ".join(f"{c} {d[c]}" for c in counts)
                         for d in sorted(self.worker_status(), key=lambda d: d["stage_id"]))  # fmt: skip

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.serve.url}/metrics", timeout=10).text
        found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0


def demo_deployment(
    redis_server_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """The `demo` fixture's body (tests/e2e/conftest.py)."""
    tmp_path = tmp_path_factory.mktemp("realtime")
    namespace = f"rt{uuid.uuid4().hex[:8]}"
    # workers beat often: the barge-in test reads their abort counts from their heartbeats
    settings = {"OMNI_NAMESPACE": namespace, "OMNI_HEARTBEAT_INTERVAL_S": "0.05"}
    group = ProcessGroup(
        OMNI, load_pipeline(OMNI, mode="streaming"), child_env(redis_server_url, settings)
    )
    group.start()
    args = ("--pipeline", str(OMNI), "--mode", "streaming", "--redis-url", redis_server_url,
            "--namespace", namespace)  # fmt: skip
    env = {"OMNI_API_KEYS": KEY, "OMNI_REALTIME_MAX_EVENT_BYTES": str(64 * 1024)}
    try:
        with ServeProcess(tmp_path / "serve.log", *args, env=env) as serve:
            yield Deployment(redis_server_url, namespace, serve)
    finally:
        group.stop()


def front_door(
    demo: Deployment, tmp_path_factory: pytest.TempPathFactory, name: str, env: dict[str, str]
) -> Iterator[Deployment]:
    """Another `serve` in front of the same deployment, with its own settings (`env`)."""
    args = ("--pipeline", str(OMNI), "--mode", "streaming", "--redis-url", demo.redis_url,
            "--namespace", demo.namespace)  # fmt: skip
    log = tmp_path_factory.mktemp(name) / "serve.log"
    with ServeProcess(log, *args, env={"OMNI_API_KEYS": KEY, **env}) as serve:
        yield Deployment(demo.redis_url, demo.namespace, serve)
