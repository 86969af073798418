"""End to end: a real redis-server, and the orchestrator and every worker as OS processes."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from omni_runtime.client import OmniClient
from omni_runtime.local import ProcessGroup, child_env
from omni_runtime.pipeline import load_pipeline
from omni_runtime.settings import Settings
from omni_runtime.types import OrchOutput

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]

WORKERS = Path(__file__).resolve().parent.parent / "workers"


class Deployment:
    """A pipeline file variant, its processes, and a client factory bound to its namespace."""

    def __init__(self, redis_url: str, tmp_path: Path, base: str, **changes: Any) -> None:
        raw = yaml.safe_load((WORKERS / base).read_text())
        for key, value in changes.items():
            if key == "stages":
                for sid, stage_changes in value.items():
                    raw["stages"][sid].update(stage_changes)
            else:
                raw[key] = value
        self.namespace = f"t{uuid.uuid4().hex[:8]}"
        self.path = tmp_path / f"{self.namespace}-{base}"
        self.path.write_text(yaml.safe_dump(raw))
        self.pipeline = load_pipeline(self.path)
        self.settings = Settings(redis_url=redis_url, namespace=self.namespace, block_ms=50)
        env = child_env(
            redis_url,
            {"OMNI_NAMESPACE": self.namespace, "OMNI_WORKER_MAX_CONCURRENCY": "4"},
        )
        self.group = ProcessGroup(self.path, self.pipeline, env)

    def __enter__(self) -> Deployment:
        self.group.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.group.stop()

    async def run_all(self, prompts: dict[str, str]) -> dict[str, list[OrchOutput]]:
        async with OmniClient(self.settings) as client:
            await client.wait_ready(list(range(self.pipeline.last_stage + 1)), timeout_s=60)
            for rid, prompt in prompts.items():
                await client.submit(prompt, request_id=rid)

            async def collect(rid: str) -> list[OrchOutput]:
                return [o async for o in client.stream(rid, timeout_s=60)]

            results = await asyncio.gather(*(collect(rid) for rid in prompts))
        return dict(zip(prompts, results, strict=True))

    def logs(self) -> str:
        return "\n".join(self.group.tail(name, 1000) for name, _p, _f in self.group.procs)


def triples(outs: list[OrchOutput]) -> list[tuple[int, Any, bool]]:
    return [(o.stage_id, o.data, o.finished) for o in outs]


@pytest.fixture
def deploy(redis_url: str, tmp_path: Path) -> Iterator[Any]:
    started: list[Deployment] = []

    def make(base: str = "seed.yaml", **changes: Any) -> Deployment:
        d = Deployment(redis_url, tmp_path, base, **changes)
        started.append(d.__enter__())
        return d

    yield make
    for d in started:
        d.__exit__()


async def test_seed_examples_with_real_processes(deploy: Any) -> None:
    both = deploy()
    only_2 = deploy(final_stage_ids=[2])
    (outs,) = (await both.run_all({"r1": "hi there"})).values()
    assert triples(outs) == [
        (0, "hi", False),
        (0, "there", False),
        (2, "wav:HI", False),
        (2, "wav:THERE", True),
    ]
    (outs,) = (await only_2.run_all({"r1": "a b c"})).values()
    assert triples(outs) == [(2, "wav:A", False), (2, "wav:B", False), (2, "wav:C", True)]


async def test_two_replicas_share_a_stage(deploy: Any) -> None:
    d = deploy(final_stage_ids=[2], stages={1: {"replicas": 2, "options": {"delay_ms": 50}}})
    prompts = {f"r{i}": f"w{i}" for i in range(24)}
    results = await d.run_all(prompts)
    assert all(triples(results[r]) == [(2, f"wav:W{r[1:]}", True)] for r in prompts)
    d.group.stop()
    completed = [
        int(m.group(1))
        for m in re.finditer(r"of stage 1 stopped: (\d+) requests completed", d.logs())
    ]
    assert len(completed) == 2 and sum(completed) == 24
    assert min(completed) > 0, f"one replica did all the work: {completed}"


async def test_200_concurrent_requests_no_loss_no_duplicate_no_leftovers(
    deploy: Any, redis_url: str
) -> None:
    d = deploy()
    prompts = {f"req-{i}": f"a{i} b{i} c{i}" for i in range(200)}
    results = await d.run_all(prompts)
    for rid, prompt in prompts.items():
        words = prompt.split()
        expected = [(0, w, False) for w in words]
        expected += [(2, f"wav:{w.upper()}", i == 2) for i, w in enumerate(words)]
        assert triples(results[rid]) == expected, rid
    client = redis.Redis.from_url(redis_url)
    try:
        leftovers = [k.decode() for k in client.scan_iter(f"{d.namespace}:*")]
        allowed = re.compile(rf"^{d.namespace}:(requests|stage:\d+:(in|out)|hb:.*)$")
        assert [k for k in leftovers if not allowed.match(k)] == []
        assert not [k for k in leftovers if "req-" in k]
        for k in leftovers:
            if client.type(k) == b"stream":
                for group in client.xinfo_groups(k):
                    assert group["pending"] == 0, k
    finally:
        client.close()
