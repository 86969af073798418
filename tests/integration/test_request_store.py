"""Durable request states in a slot's hash: two commands per batch, an expiry that only moves
forward (or goes persistent), states that come back as written, stale ones dropped on load."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import fakeredis
import pytest

from omni_runtime import codec, keys
from omni_runtime.core.types import ReqState
from omni_runtime.messages import WIRE_VERSION
from omni_runtime.redis_io.request_store import GRACE_S, RequestStore
from omni_runtime.redis_io.write_ops import ExpireAt, HashDrop, HashPut, fill_pipeline
from omni_runtime.redis_io.writer import StreamWriter

NAMES = keys.Names("t")


def describe_with(deadlines: dict[str, float | None]) -> Any:
    def describe(rid: str, state: ReqState) -> dict[str, Any]:
        return {
            "v": WIRE_VERSION,
            "type": "request_state",
            "request_id": rid,
            "client_id": "c1",
            "prompt": state.prompt,
            "deadline_at": deadlines[rid],
            "submitted": sorted(state.submitted),
            "finished": sorted(state.finished),
            "stage_data": {},
            "stage_seq": {},
            "out_seq": 0,
        }

    return describe


def store_for(client: Any, deadlines: dict[str, float | None], now: float) -> RequestStore:
    writer = StreamWriter(client, maxlen=100)
    return RequestStore(writer, NAMES, 0, describe_with(deadlines), clock=lambda: now)


def state(prompt: str = "p") -> ReqState:
    return ReqState(prompt=prompt, submitted={0}, finished=set(), stage_data={})


def test_one_hset_per_batch_and_an_expiry_that_only_moves_forward() -> None:
    now = time.time()  # expiries are real: Redis drops a key whose PEXPIREAT passed
    deadlines: dict[str, float | None] = {"a": now + 10, "b": now + 30, "c": now + 20}
    store = store_for(fakeredis.FakeAsyncRedis(), deadlines, now)
    store.changed("a", state())
    store.changed("b", state())
    ops = store.ops()
    assert [type(op) for op in ops] == [HashPut, ExpireAt]
    put, expire = ops
    assert isinstance(put, HashPut) and put.fields.keys() == {"a", "b"}
    assert isinstance(expire, ExpireAt) and expire.at_ms == int((now + 30 + GRACE_S) * 1000)
    store.changed("c", state())  # an earlier deadline than b's: the expiry stays
    store.changed("a", None)
    ops = store.ops()
    assert [type(op) for op in ops] == [HashPut, HashDrop]
    assert isinstance(ops[1], HashDrop) and ops[1].fields == ["a"]
    deadlines["d"] = None  # no deadline: the hash must not expire
    store.changed("d", state())
    assert isinstance(last := store.ops()[-1], ExpireAt) and last.at_ms is None


def test_a_request_that_ends_within_one_batch_writes_nothing() -> None:
    now = time.time()  # expiries are real: Redis drops a key whose PEXPIREAT passed
    store = store_for(fakeredis.FakeAsyncRedis(), {"a": now + 10}, now)
    store.changed("a", state())
    store.changed("a", None)
    assert store.ops() == []


def test_states_come_back_and_stale_or_unreadable_ones_are_dropped() -> None:
    now = time.time()  # expiries are real: Redis drops a key whose PEXPIREAT passed

    async def main() -> None:
        client = fakeredis.FakeAsyncRedis()
        deadlines: dict[str, float | None] = {"live": now + 5, "old": now - GRACE_S - 1}
        first = store_for(client, deadlines, now)
        first.changed("live", state("hello"))
        first.changed("old", state())
        first.writer.sources.clear()
        async with client.pipeline(transaction=False) as pipe:
            fill_pipeline(pipe, first.ops())
            await pipe.execute()
        key = NAMES.orchestrator_states(0)
        await client.hset(key, "junk", b"\x01not msgpack")
        second = store_for(client, deadlines, now)
        docs = await second.load(client, max_bytes=1 << 20)
        assert [(d.request_id, d.prompt) for d in docs] == [("live", "hello")]
        assert await client.hkeys(key) == [b"live"]
        blob = await client.hget(key, "live")
        assert isinstance(blob, bytes) and codec.decode(blob)["prompt"] == "hello"
        await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("ended", [True, False])
def test_the_hash_goes_with_its_last_state(ended: bool) -> None:
    now = time.time()  # expiries are real: Redis drops a key whose PEXPIREAT passed

    async def main() -> None:
        client = fakeredis.FakeAsyncRedis()
        store = store_for(client, {"a": now + 5}, now)

        async def flush() -> None:
            async with client.pipeline(transaction=False) as pipe:
                fill_pipeline(pipe, store.ops())
                await pipe.execute()

        store.changed("a", state())
        await flush()
        if ended:
            store.changed("a", None)
            await flush()
        assert await client.exists(NAMES.orchestrator_states(0)) == (0 if ended else 1)
        await client.aclose()

    asyncio.run(main())
