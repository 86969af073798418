"""Durable request states in a slot's hash: two commands per batch, an expiry that only moves
forward (or goes persistent), states that come back as written, stale ones dropped on load."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import fakeredis
import pytest

from omni_runtime import keys
from omni_runtime.core.types import ReqState
from omni_runtime.orchestrator.request_store import GRACE_S, RequestStore, to_state
from omni_runtime.redis_io.write_ops import ExpireAt, HashDrop, HashPut, fill_pipeline
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import codec, outgoing
from omni_runtime.wire.outgoing import DurableRequestOut

NAMES = keys.Names("t")


def describe_with(deadlines: dict[str, float | None]) -> Any:
    def describe(rid: str, state: ReqState) -> DurableRequestOut:
        return DurableRequestOut(
            request_id=rid,
            client_id="c1",
            prompt=state.prompt,
            deadline_at=deadlines[rid],
            submitted=sorted(state.submitted),
            finished=sorted(state.finished),
        )

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


def describe_kept(rid: str, state: ReqState) -> DurableRequestOut:
    """As the orchestrator's: the data of every stage not finished (sequential mode)."""
    doc: DurableRequestOut = describe_with({rid: None})(rid, state)
    kept = {s: d for s, d in state.stage_data.items() if s not in state.finished}
    return outgoing.replace(doc, stage_data=kept)


def chunk(sid: int, i: int, rid: str = "a") -> bytes:
    return keys.state_chunk_field(rid, sid, i)


async def written(client: Any, store: RequestStore) -> None:
    async with client.pipeline(transaction=False) as pipe:
        fill_pipeline(pipe, store.ops())
        await pipe.execute()


def test_each_chunk_of_kept_data_is_written_once_and_dropped_with_its_stage() -> None:
    store = RequestStore(StreamWriter(fakeredis.FakeAsyncRedis(), 100), NAMES, 0, describe_kept)
    st = ReqState(prompt="p", submitted={0}, stage_data={0: [b"x" * 4096]})
    store.changed("a", st)
    put, _expire = store.ops()
    assert isinstance(put, HashPut) and put.fields.keys() == {"a", chunk(0, 0)}
    assert put.fields[chunk(0, 0)] == codec.encode(b"x" * 4096)
    assert len(put.fields["a"]) < 200  # the state counts its chunks, it does not carry them
    assert codec.decode(put.fields["a"])["stage_chunks"] == {0: 1}
    st.stage_data[0] += [b"y", b"z"]
    store.changed("a", st)
    (put,) = store.ops()  # only the new chunks, whatever was written before
    assert isinstance(put, HashPut) and put.fields.keys() == {"a", chunk(0, 1), chunk(0, 2)}
    st.finished.add(0)  # forwarded: nothing left to keep
    st.submitted.add(1)
    st.stage_data[1] = ["w"]
    store.changed("a", st)
    put, drop = store.ops()
    assert isinstance(put, HashPut) and put.fields.keys() == {"a", chunk(1, 0)}
    assert isinstance(drop, HashDrop) and drop.fields == [chunk(0, 0), chunk(0, 1), chunk(0, 2)]
    store.changed("a", None)
    (drop,) = store.ops()
    assert isinstance(drop, HashDrop) and drop.fields == ["a", chunk(1, 0)]


def test_kept_data_comes_back_whole_and_a_takeover_goes_on_appending() -> None:
    async def main() -> None:
        client = fakeredis.FakeAsyncRedis()
        first = RequestStore(StreamWriter(client, 100), NAMES, 0, describe_kept)
        st = ReqState(prompt="p", submitted={0}, stage_data={0: ["t0"]})
        for word in ("t1", "t2"):
            first.changed("a", st)
            await written(client, first)
            st.stage_data[0].append(word)
        first.changed("a", st)
        await written(client, first)
        second = RequestStore(StreamWriter(client, 100), NAMES, 0, describe_kept)
        (doc,) = await second.load(client, max_bytes=1 << 20)
        restored = to_state(doc)
        assert restored.stage_data == {0: ["t0", "t1", "t2"]} and doc.stage_chunks == {0: 3}
        restored.stage_data[0].append("t3")
        second.changed("a", restored)
        (put,) = second.ops()
        assert isinstance(put, HashPut) and put.fields.keys() == {"a", chunk(0, 3)}
        await client.aclose()

    asyncio.run(main())


def test_load_drops_chunks_no_state_counts_and_states_missing_a_chunk() -> None:
    async def main() -> None:
        client = fakeredis.FakeAsyncRedis()
        store = RequestStore(StreamWriter(client, 100), NAMES, 0, describe_kept)
        for rid in ("whole", "torn"):
            store.changed(rid, ReqState(prompt=rid, submitted={0}, stage_data={0: [1, 2]}))
        await written(client, store)
        key = NAMES.orchestrator_states(0)
        await client.hdel(key, chunk(0, 1, "torn"))  # a state that counts a chunk not there
        await client.hset(key, chunk(0, 0, "gone"), codec.encode(1))  # no state counts it
        await client.hset(key, chunk(0, 2, "whole"), codec.encode(3))  # beyond its count
        await client.hset(key, b"\xfe junk", b"")  # neither a request id nor a chunk
        again = RequestStore(StreamWriter(client, 100), NAMES, 0, describe_kept)
        docs = await again.load(client, max_bytes=1 << 20)
        assert [(d.request_id, d.stage_data) for d in docs] == [("whole", {0: [1, 2]})]
        assert sorted(await client.hkeys(key)) == sorted(
            [b"whole", chunk(0, 0, "whole"), chunk(0, 1, "whole")]
        )
        await client.aclose()

    asyncio.run(main())


def test_a_state_with_its_data_inline_loads_and_moves_it_to_chunk_fields() -> None:
    """States written before chunk fields carry their data in `stage_data`."""

    async def main() -> None:
        client = fakeredis.FakeAsyncRedis()
        key = NAMES.orchestrator_states(0)
        old = describe_kept("a", ReqState(prompt="p", submitted={0}, stage_data={0: ["t0"]}))
        await client.hset(key, "a", outgoing.encode(old))
        store = RequestStore(StreamWriter(client, 100), NAMES, 0, describe_kept)
        (doc,) = await store.load(client, max_bytes=1 << 20)
        st = to_state(doc)
        assert st.stage_data == {0: ["t0"]}
        st.stage_data[0].append("t1")
        store.changed("a", st)
        (put,) = store.ops()
        assert isinstance(put, HashPut) and put.fields.keys() == {"a", chunk(0, 0), chunk(0, 1)}
        await client.aclose()

    asyncio.run(main())


def test_an_id_ended_and_submitted_again_within_a_batch_writes_its_chunks_anew() -> None:
    store = RequestStore(StreamWriter(fakeredis.FakeAsyncRedis(), 100), NAMES, 0, describe_kept)
    store.changed("a", ReqState(prompt="p", submitted={0}, stage_data={0: ["a", "b", "c"]}))
    store.ops()
    store.changed("a", None)
    store.changed("a", ReqState(prompt="q", submitted={0}, stage_data={0: ["d"]}))
    put, drop = store.ops()
    assert isinstance(put, HashPut) and put.fields[chunk(0, 0)] == codec.encode("d")
    assert isinstance(drop, HashDrop) and drop.fields == [chunk(0, 1), chunk(0, 2)]
