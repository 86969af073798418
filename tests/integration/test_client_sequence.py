"""The client's side of SPEC §6 over fakeredis: outputs written to its stream by hand."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest

from omni_runtime.client.client import OmniClient
from omni_runtime.core.types import OrchOutput
from omni_runtime.errors import RequestTimeoutError
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.streams import entry_fields, parse_entry, stream_reply
from omni_runtime.redis_io.write_ops import xadd_fields
from omni_runtime.settings import Settings
from omni_runtime.wire import codec
from omni_runtime.wire.messages import AbortMsg, OrchOutputMsg, RequestMsg
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake_clients() -> RedisClients:
    server = fakeredis.FakeServer()
    return RedisClients(
        sync=lambda: fakeredis.FakeRedis(server=server),
        aio=lambda: fakeredis.FakeAsyncRedis(server=server),
    )


def settings(**changes: Any) -> Settings:
    return Settings(
        redis_url="redis://unused",
        block_ms=20,
        orchestrator_idle_block_ms=20,  # fakeredis goes on with a cancelled blocking read
        heartbeat_interval_s=0.2,
        **changes,
    )


def out(rid: str, seq: int, data: Any, finished: bool = False) -> dict[str, bytes]:
    msg = OrchOutputMsg(request_id=rid, stage_id=2, data=data, finished=finished, seq=seq)
    return entry_fields(msg)


async def send(client: OmniClient, *entries: dict[str, Any]) -> None:
    for fields in entries:
        await client.redis.xadd(client.out_stream, xadd_fields(fields))


async def outputs(client: OmniClient, rid: str) -> list[OrchOutput]:
    return [o async for o in client.stream(rid, timeout_s=10)]


async def aborts_sent(client: OmniClient) -> list[AbortMsg]:
    await client._writer.flushed()
    reply = await client.redis.xread({client.names.requests: "0-0"})
    found = []
    for _s, entries in stream_reply(reply):
        for _id, fields in entries:
            obj = codec.decode(fields[b"m"])
            if obj["type"] == "abort":
                found.append(parse_entry(fields, AbortMsg, 1 << 20))
    return found


async def test_repeats_are_dropped_and_counted(fake_clients: RedisClients) -> None:
    async with OmniClient(settings(), fake_clients) as client:
        rid = await client.submit("x", request_id="r")
        await send(client, out(rid, 0, "a"), out(rid, 0, "a"), out(rid, 1, "b"))
        await send(client, out(rid, 1, "b"), out(rid, 2, "c", True), out(rid, 2, "c", True))
        got = await outputs(client, rid)
        assert [(o.data, o.finished, o.error) for o in got] == [
            ("a", False, None),
            ("b", False, None),
            ("c", True, None),
        ]
        assert client.metrics.value("omni_duplicate_outputs_total", source="client") == 2


async def test_a_gap_ends_the_request_with_one_error_final(fake_clients: RedisClients) -> None:
    async with OmniClient(settings(), fake_clients) as client:
        rid = await client.submit("x", request_id="r")
        await send(client, out(rid, 0, "a"), out(rid, 2, "c"), out(rid, 3, "d", True))
        got = await outputs(client, rid)
        assert [(o.data, o.finished, o.error) for o in got] == [
            ("a", False, None),
            (None, True, "outputs lost: expected seq 1, got 2"),
        ]
        assert client.metrics.value("omni_outputs_lost_total") == 1
        assert [a.request_id for a in await aborts_sent(client)] == ["r"]


async def test_a_request_with_no_output_within_its_timeout_ends_and_is_aborted(
    fake_clients: RedisClients,
) -> None:
    async with OmniClient(settings(), fake_clients) as client:
        rid = await client.submit("x", request_id="r")
        await send(client, out(rid, 0, "a"))
        got = []
        with pytest.raises(RequestTimeoutError, match=r"no output for request 'r' within 0\.3s"):
            async for o in client.stream(rid, timeout_s=0.3):
                got.append(o.data)
        assert got == ["a"]
        assert client.inbox.requests == {}
        assert [a.request_id for a in await aborts_sent(client)] == ["r"]


async def test_a_stalled_consumer_past_the_bound_is_aborted_and_freed(
    fake_clients: RedisClients,
) -> None:
    async with OmniClient(settings(client_buffer_outputs=3), fake_clients) as client:
        rid = await client.submit("x", request_id="r")
        await send(client, *(out(rid, i, i) for i in range(5)))
        await send(client, out(rid, 5, "end", True))
        got = await outputs(client, rid)
        assert len(got) == 1 and got[0].finished
        assert got[0].error is not None and "client buffer full" in got[0].error
        assert client.inbox.requests == {}
        assert [a.request_id for a in await aborts_sent(client)] == ["r"]


async def test_malformed_client_entries_are_dead_lettered(fake_clients: RedisClients) -> None:
    async with OmniClient(settings(), fake_clients) as client:
        rid = await client.submit("x", request_id="r")
        bad = codec.encode({"type": "orch_output", "request_id": b"r", "stage_id": 2})
        await send(client, {"m": b"\x00junk"}, {"m": bad}, {"x": b"1"})
        await send(client, out(rid, 0, "a", True))
        got = await outputs(client, rid)
        assert [(o.data, o.finished) for o in got] == [("a", True)]
        stream = client.out_stream
        assert client.metrics.value("omni_malformed_entries_total", stream=stream) == 3
        assert client.metrics.value("omni_dead_letters_total", stream=stream) == 3
        assert await client.redis.xlen(client.names.dead_letters) == 3


def test_request_ids_sent_as_bytes_are_refused() -> None:
    good = {"type": "request", "request_id": "r", "client_id": "c", "prompt": 1}
    assert parse_entry({b"m": codec.encode(good)}, RequestMsg, 1 << 20).request_id == "r"
    for field in ("request_id", "client_id"):
        bad = {**good, field: field.encode()}
        with pytest.raises(Exception, match=field):
            parse_entry({b"m": codec.encode(bad)}, RequestMsg, 1 << 20)


async def test_what_the_client_read_leaves_its_stream_with_its_next_read(
    fake_clients: RedisClients,
) -> None:
    """Read once: the entries are deleted (so the stream stays short) in the same send as
    the next read, not by a round trip of their own."""
    async with OmniClient(settings(), fake_clients) as client:
        rid = await client.submit("x", request_id="r")
        await send(client, out(rid, 0, "a"), out(rid, 1, "b", True))
        assert [o.data for o in await outputs(client, rid)] == ["a", "b"]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while await client.redis.xlen(client.out_stream):  # the next read is one block away
            assert loop.time() < deadline, "the entries read were not deleted"
            await asyncio.sleep(0.01)


async def test_outputs_read_reach_their_consumer_before_the_next_read_is_sent(
    fake_clients: RedisClients,
) -> None:
    """Sent first, the next read's packing and sending would delay every output on its
    way to the consumer (~0.13 ms a request at light load on a 2-core machine)."""
    events: list[str] = []
    async with OmniClient(settings(), fake_clients) as client:
        reads = client._reads
        real_xread = reads.xread

        async def logged(*args: Any, **kwargs: Any) -> Any:
            events.append("sent")
            batch = await real_xread(*args, **kwargs)
            events.append("returned")
            return batch

        reads.xread = logged  # type: ignore[method-assign]
        rid = await client.submit("x", request_id="r")
        got: list[int] = []

        async def consume() -> None:
            async for o in client.stream(rid, timeout_s=10):
                events.append(f"got {o.data}")
                got.append(o.data)

        consumer = asyncio.create_task(consume())
        for seq in range(3):  # one at a time: each comes in a read of its own
            await send(client, out(rid, seq, seq, finished=seq == 2))
            await wait_for(lambda: len(got) > seq)  # noqa: B023 (awaited in the loop)
        await consumer
    assert got == [0, 1, 2]
    for seq in range(3):  # between the read that brought it and its consumer: no read sent
        before = [e for e in events[: events.index(f"got {seq}")] if e in ("sent", "returned")]
        assert before[-1] == "returned", events


async def test_every_task_cancelled_at_once_as_on_ctrl_c_ends_at_once(
    fake_clients: RedisClients,
) -> None:
    """asyncio.run on Ctrl-C cancels every task at once, the client's reader and writer
    among them: closing waited out a 2 s flush of a writer that was gone."""
    opened: list[OmniClient] = []
    submitted = asyncio.Event()

    async def app() -> None:
        async with OmniClient(settings(), fake_clients) as client:
            opened.append(client)
            await client.submit("x", request_id="r")
            submitted.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(app())
    await asyncio.wait_for(submitted.wait(), 10)
    client = opened[0]
    assert client._reader is not None
    every = [task, client._writer_task, client._reader]
    for t in every:
        t.cancel()
    async with asyncio.timeout(1.5):
        await asyncio.gather(*every, return_exceptions=True)
    assert task.cancelled()
    assert client._writer.dropped_writes >= 1  # the request's abort, counted
