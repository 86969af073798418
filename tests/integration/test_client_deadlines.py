"""The client ends every request by its deadline and grace, whatever Redis and the
orchestrators do, saying what it knows; a submission Redis refuses for memory fails at
once; Redis back empty ends nothing by itself. No orchestrator runs here: outputs are
written to the client's stream by hand, as an orchestrator would."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import fakeredis
import pytest
import redis

from omni_runtime.client.client import OmniClient
from omni_runtime.core.types import OrchOutput
from omni_runtime.errors import OOM_MESSAGE, RedisOutOfMemoryError, TransportError
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.streams import entry_fields
from omni_runtime.redis_io.write_ops import xadd_fields
from omni_runtime.settings import Settings
from omni_runtime.wire.messages import OrchOutputMsg
from tests.redis_full import FullableRedis
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

DEADLINE_S, GRACE_S = 0.5, 0.3


def settings(url: str = "redis://unused", **changes: Any) -> Settings:
    base: dict[str, Any] = {
        "redis_url": url,
        "block_ms": 20,
        "heartbeat_interval_s": 0.2,
        "deadline_s": DEADLINE_S,
        "deadline_grace_s": GRACE_S,
        "retry_attempts": 2,
    }
    return Settings(**{**base, **changes})


def fake_clients() -> RedisClients:
    server = fakeredis.FakeServer()
    return RedisClients(
        sync=lambda: fakeredis.FakeRedis(server=server),
        aio=lambda: fakeredis.FakeAsyncRedis(server=server),
    )


async def ended(client: OmniClient, rid: str) -> tuple[list[OrchOutput], float]:
    """The request's outputs, and how long after now its final came."""
    t0 = time.monotonic()
    outs = [o async for o in client.stream(rid, timeout_s=30)]
    return outs, time.monotonic() - t0


async def test_no_answer_ends_the_request_at_its_deadline_and_grace() -> None:
    async with OmniClient(settings(), fake_clients()) as client:
        t0 = time.monotonic()
        rid = await client.submit("a b")
        outs, _ = await ended(client, rid)
        took = time.monotonic() - t0
    assert len(outs) == 1 and outs[0].finished
    error = outs[0].error or ""
    assert error.startswith("deadline exceeded: no final within 0.5 s (+0.3 s grace)"), error
    assert error.endswith("no answer from the orchestrator")
    assert DEADLINE_S + GRACE_S <= took < DEADLINE_S + GRACE_S + 1.0
    assert client.metrics.value("omni_deadline_exceeded_total", source="client") == 1


async def test_a_final_in_time_cancels_the_clients_own_deadline() -> None:
    async with OmniClient(settings(deadline_s=60.0), fake_clients()) as client:
        rid = await client.submit("a b", deadline_s=0.2)  # the request's own deadline
        outs, took = await ended(client, rid)
        assert outs[0].error is not None and took < 2
        other = await client.submit("c")
        msg = OrchOutputMsg(request_id=other, stage_id=2, data="C", finished=True, seq=0)
        await client.redis.xadd(client.out_stream, xadd_fields(entry_fields(msg)))
        assert [o.data for o in (await ended(client, other))[0]] == ["C"]
        assert len(client._deadlines) == 0


async def test_redis_out_of_memory_refuses_a_submission_at_once_and_names_the_deadline(
    full_redis: FullableRedis,
) -> None:
    s = settings(full_redis.url, deadline_s=1.0, heartbeat_ttl_s=0.5)  # Redis full for longer
    async with OmniClient(s, RedisClients.from_url(full_redis.url)) as client:
        probe = redis.Redis.from_url(full_redis.url)
        waiting = await client.submit("a b")  # in before Redis filled up
        with full_redis.full():
            t0 = time.monotonic()
            with pytest.raises(RedisOutOfMemoryError, match=f"^{OOM_MESSAGE}") as refused:
                await client.submit("c d", request_id="late")
            assert time.monotonic() - t0 < 0.1
            assert "'late' not submitted" in str(refused.value)
            assert "late" not in client.inbox.requests
            await wait_for(lambda: client.out_of_memory is not None, deadline_s=5)
            outs, _ = await ended(client, waiting)
            hb = client._heartbeat_key
            assert probe.exists(hb)  # kept alive by PEXPIRE: not taken for gone
        assert probe.xlen(client.names.requests) == 1  # the refused one was never written
        await wait_for(lambda: client.out_of_memory is None, deadline_s=5)
        probe.close()
    error = outs[-1].error or ""
    assert error.startswith("deadline exceeded") and OOM_MESSAGE in error, error
    assert client.metrics.value("omni_requests_refused_total", reason="redis out of memory") == 1


async def test_redis_unreachable_is_what_the_deadline_error_says(
    full_redis: FullableRedis,
) -> None:
    async with OmniClient(settings(full_redis.url), RedisClients.from_url(full_redis.url)) as c:
        rid = await c.submit("a b")
        full_redis.kill()
        outs, _ = await ended(c, rid)
    assert "Redis unreachable for" in (outs[-1].error or ""), outs


async def test_redis_back_empty_ends_nothing_a_final_may_still_come() -> None:
    """The client does not guess: its request's orchestrator may still answer."""
    clients = fake_clients()
    async with OmniClient(settings(deadline_s=30.0), clients) as client:
        rid = await client.submit("a b")
        seen = client.metrics.value("omni_retries_total")
        await client.redis.flushall()  # Redis back empty: the epoch token is gone
        await wait_for(lambda: client.redis_condition.restarted_at is not None, deadline_s=5)
        assert seen == client.metrics.value("omni_retries_total")
        assert not client.inbox.requests[rid].ended
        msg = OrchOutputMsg(request_id=rid, stage_id=2, data="done", finished=True, seq=0)
        await client.redis.xadd(client.out_stream, xadd_fields(entry_fields(msg)))
        outs, _ = await ended(client, rid)
    assert [(o.data, o.error) for o in outs] == [("done", None)]
    assert client.metrics.value("omni_late_successes_total") == 0


async def test_a_success_after_the_request_ended_with_an_error_is_counted() -> None:
    async with OmniClient(settings(deadline_s=0.2, deadline_grace_s=0.0), fake_clients()) as c:
        rid = await c.submit("a")
        outs, _ = await ended(c, rid)
        assert outs[-1].error is not None
        msg = OrchOutputMsg(request_id=rid, stage_id=2, data="late", finished=True, seq=0)
        await c.redis.xadd(c.out_stream, xadd_fields(entry_fields(msg)))
        await wait_for(lambda: c.metrics.value("omni_late_successes_total") == 1, deadline_s=5)
    assert c.metrics.value("omni_late_successes_total", reason="deadline exceeded") == 1


async def test_the_deadline_task_wakes_for_an_earlier_deadline() -> None:
    """A request with a shorter deadline than those before it is not held up by them."""
    async with OmniClient(settings(deadline_s=30.0), fake_clients()) as client:
        await client.submit("slow")
        rid = await client.submit("quick", deadline_s=0.2)
        outs, took = await asyncio.wait_for(ended(client, rid), 10)
    assert outs[-1].error is not None and took < 2


async def test_a_reader_that_dies_of_a_bug_ends_every_request_at_once() -> None:
    """Not a Redis failure (those are retried) but a bug, here one of redis-py's: the
    requests in flight end with it at once, not at their deadline, and `submit` refuses."""
    async with OmniClient(settings(deadline_s=30.0), fake_clients()) as client:
        rid = await client.submit("a b")

        async def broken(*_args: Any) -> Any:
            raise AttributeError("'NoneType' object has no attribute 'writelines'")

        client._reads.xread = broken  # type: ignore[method-assign,assignment]
        outs, took = await ended(client, rid)
        assert [o.finished for o in outs] == [True] and took < 10.0
        assert "output reader failed: AttributeError" in (outs[0].error or "")
        with pytest.raises(TransportError, match="can read no answer"):
            await client.submit("c d")
