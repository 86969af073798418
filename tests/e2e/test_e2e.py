"""End to end: a real redis-server, and the orchestrator and every worker as OS processes.

The omni pipeline in both modes runs again on a real 3-master Redis Cluster (same code,
any node's URL), on Valkey and through Redis Sentinel (`on_all`); `tests/e2e/test_cluster.py` runs the seed
pipeline in both modes on the cluster, through `omni-runtime run`."""

from __future__ import annotations

import asyncio
import json
import random
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import yaml

from omni_runtime.client.client import OmniClient
from omni_runtime.core.types import OrchOutput
from omni_runtime.local.launcher import ProcessGroup, child_env
from omni_runtime.pipeline import load_pipeline
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings
from tests.backends import REAL_REDIS_FIXTURES
from tests.waiting import wait_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]

on_all = pytest.mark.parametrize(
    "deploy", ["redis-server", "redis-cluster", "valkey", "redis-sentinel"], indirect=True
)
"""Run the test on the single redis-server, the Redis Cluster, Valkey and Redis Sentinel."""

WORKERS = Path(__file__).resolve().parents[2] / "workers"


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
        self.redis = RedisClients.from_url(redis_url).sync()

    def __enter__(self) -> Deployment:
        self.group.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.group.stop()
        self.redis.close()

    def heartbeats(self, stage_id: int) -> list[dict[str, Any]]:
        """The status documents of the stage's live workers (their heartbeat values)."""
        found = list(self.redis.scan_iter(self.settings.names.heartbeat_pattern(stage_id)))
        return [json.loads(v) for v in map(self.redis.get, found) if v is not None]

    async def wait_all_replicas(self) -> None:
        """Every configured replica beats: work submitted now can reach each of them."""
        stages = self.pipeline.stages[: self.pipeline.last_stage + 1]
        await wait_for(lambda: all(len(self.heartbeats(s.id)) >= s.replicas for s in stages), 60)

    async def run_all(self, prompts: dict[str, str]) -> dict[str, list[OrchOutput]]:
        async with OmniClient(self.settings) as client:
            await client.wait_ready(list(range(self.pipeline.last_stage + 1)), timeout_s=60)
            await self.wait_all_replicas()
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
def deploy(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """Deployments on the redis-server, or on the Redis Cluster when parametrized so."""
    url = request.getfixturevalue(REAL_REDIS_FIXTURES[getattr(request, "param", "redis-server")])
    started: list[Deployment] = []

    def make(base: str = "seed.yaml", **changes: Any) -> Deployment:
        d = Deployment(url, tmp_path, base, **changes)
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
    results = await d.run_all(prompts)  # starts once both replicas beat
    assert all(triples(results[r]) == [(2, f"wav:W{r[1:]}", True)] for r in prompts)

    def completed() -> list[int]:
        return sorted(h["completed"] for h in d.heartbeats(1))

    await wait_for(lambda: sum(completed()) == 24, deadline_s=15)  # beats every second
    assert len(completed()) == 2
    assert min(completed()) > 0, f"one replica did all the work: {completed()}"
    d.group.stop()
    assert "stage code still running" not in d.logs(), "a clean shutdown leaves no stage thread"


async def test_a_step_engine_failing_some_inputs_fails_only_those_requests(
    deploy: Any, redis_url: str
) -> None:
    d = deploy(final_stage_ids=[2], stages={1: {"entry": "tests.odd_stages:Picky", "options": {}}})
    prompts = {f"g{i}": f"w{i}" for i in range(8)}
    prompts |= {"bad1": "x bad-add", "bad2": "bad-step y", "bad3": "bad-add bad-step"}
    results = await d.run_all(prompts)
    for rid, outs in results.items():
        if rid.startswith("g"):
            assert triples(outs) == [(2, f"wav:W{rid[1:]}", True)], rid
            continue
        assert len(outs) == 1 and outs[0].finished and outs[0].stage_id == 1, rid
        error = outs[0].error or ""
        assert error.startswith("stage 1 failed:") and "refusing bad-" in error, error
    d.group.check_alive()  # the replica lives on ...
    again = await d.run_all({"after": "still fine"})
    assert triples(again["after"]) == [(2, "wav:STILL", False), (2, "wav:FINE", True)]
    await wait_for(lambda: [h["failed"] for h in d.heartbeats(1)] == [3], deadline_s=15)
    r = redis.Redis.from_url(redis_url)
    try:  # ... and holds nothing back
        assert r.xpending(d.settings.names.stage_in(1), "workers")["pending"] == 0
    finally:
        r.close()


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
        # streams, heartbeats (and the epoch key), the published stats of live processes,
        # the orchestrator slot registry and live leases; never a request's state
        allowed = re.compile(
            rf"^{d.namespace}:(requests|control|stage:\d+:(in|out)|hb:.*|stats:.*|orch:\{{slots\}}:(registry|lease:\d+|gen:\d+))$"
        )
        assert [k for k in leftovers if not allowed.match(k)] == []
        assert not [k for k in leftovers if "req-" in k]
        for k in leftovers:
            if client.type(k) == b"stream":
                for group in client.xinfo_groups(k):
                    assert group["pending"] == 0, k
    finally:
        client.close()


def omni(**options: Any) -> dict[str, Any]:
    """Changes for workers/omni.yaml: fast stand-in models for tests."""
    return {
        "stages": {
            0: {"options": {"token_delay_ms": options.get("token_delay_ms", 1)}},
            1: {"options": {"code_delay_ms": 0}},
        }
    }


@on_all
async def test_streaming_and_sequential_give_identical_outputs(deploy: Any) -> None:
    prompts = {f"q{i}": f"Hello number {i}, streaming world!" for i in range(10)}
    seq = await deploy("omni.yaml", mode="sequential", **omni()).run_all(prompts)
    stream = await deploy("omni.yaml", mode="streaming", **omni()).run_all(prompts)
    for rid in prompts:
        a, b = seq[rid], stream[rid]
        assert all(o.error is None for o in a + b), rid
        text_a = [o.data for o in a if o.stage_id == 0]
        text_b = [o.data for o in b if o.stage_id == 0]
        assert text_a == text_b == re.findall(r"\w+|[^\w\s]", prompts[rid])
        audio_a = [o.data for o in a if o.stage_id == 2]
        audio_b = [o.data for o in b if o.stage_id == 2]
        assert len(audio_a) == len(audio_b) == len(text_a)
        assert all(
            np.array_equal(x, y) and x.dtype == y.dtype
            for x, y in zip(audio_a, audio_b, strict=True)
        )
        assert a[-1].finished and b[-1].finished
        assert sum(o.finished for o in a) == sum(o.finished for o in b) == 1


async def test_abort_storm_leaves_one_final_output_each_and_nothing_behind(
    deploy: Any, redis_url: str
) -> None:
    d = deploy("omni.yaml", mode="streaming", **omni(token_delay_ms=2))
    rng = random.Random(11)
    n, concurrency = 500, 50
    finals: dict[str, list[OrchOutput]] = {}
    async with OmniClient(d.settings) as client:
        await client.wait_ready([0, 1, 2], timeout_s=60)
        slots = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with slots:
                rid = f"storm-{i}"
                await client.submit(f"token {i} " * rng.randint(3, 30), request_id=rid)
                abort_after = rng.random() * 0.08 if i % 2 else None
                outs: list[OrchOutput] = []

                async def consume() -> None:
                    async for out in client.stream(rid, timeout_s=60):
                        outs.append(out)

                task = asyncio.create_task(consume())
                if abort_after is not None:
                    await asyncio.sleep(abort_after)  # a random moment of the request's life
                    await client.abort(rid)
                await task
                finals[rid] = [o for o in outs if o.finished]

        await asyncio.gather(*(one(i) for i in range(n)))
    assert len(finals) == n
    assert all(len(f) == 1 for f in finals.values()), "every request has exactly one final output"
    aborted = [f[0] for f in finals.values() if f[0].error is not None]
    assert aborted and all(f.error == "aborted" for f in aborted)
    assert all(f[0].error is None for rid, f in finals.items() if int(rid.split("-")[1]) % 2 == 0)
    # no chunk key of any request left in Redis (unread chunks are swept within ~1 s)
    client_r = redis.Redis.from_url(redis_url)
    try:

        def chunk_keys() -> list[bytes]:
            return [k for k in client_r.scan_iter(f"{d.namespace}:chunk:*") if b":notify:" not in k]

        try:
            await wait_for(lambda: not chunk_keys(), deadline_s=15)
        except AssertionError:
            raise AssertionError(f"chunk keys left behind: {chunk_keys()[:10]}") from None
    finally:
        client_r.close()
    d.group.stop()
    still_active = [int(m.group(1)) for m in re.finditer(r"stopped: .*\bin_flight=(\d+)", d.logs())]
    assert len(still_active) == 3 and sum(still_active) == 0, "no worker holds state for them"


async def test_a_killed_replica_loses_nothing(deploy: Any) -> None:
    """SIGKILL one of two replicas mid-work: the other takes over its unacknowledged inputs
    once its heartbeat expired, and every request still ends once, correctly."""
    d = deploy(final_stage_ids=[2], stages={1: {"replicas": 2, "options": {"delay_ms": 300}}})
    prompts = {f"k{i}": f"w{i}" for i in range(16)}
    async with OmniClient(d.settings) as client:
        await client.wait_ready([0, 1, 2], timeout_s=60)
        for rid, prompt in prompts.items():
            await client.submit(prompt, request_id=rid)
        victim_name, victim = next(
            (name, p)
            for name, p, _f in d.group.procs
            if name.startswith("stage1-") and name.endswith("-0")
        )
        raw = redis.Redis.from_url(d.settings.redis_url or "")
        try:  # kill it while it holds inputs it has not acknowledged
            consumer = d.group.process_ids[victim_name].encode()  # its name in Redis
            await wait_for(
                lambda: any(
                    c["name"] == consumer and c["pending"] > 0
                    for c in raw.xinfo_consumers(d.settings.names.stage_in(1), "workers")
                ),
                deadline_s=30,
            )
        finally:
            raw.close()
        victim.kill()
        results = {rid: [o async for o in client.stream(rid, timeout_s=60)] for rid in prompts}
    for rid, outs in results.items():
        assert triples(outs) == [(2, f"wav:W{rid[1:]}", True)], rid
