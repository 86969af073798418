"""On a real Redis Cluster, a batch's writes reach Redis in the order they depend on.

One cluster pipeline sends every node its commands at once, so a request's state (or an
acknowledgement) could land on its node before the entry it records lands on another:
an orchestrator or worker killed between the two writes then loses that entry for good
(`tests/faults/test_orchestrator_sigkill.py` lost a request's final that way under load).
The writers send each group only once Redis has answered the one before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.clients import async_client, sync_client
from omni_runtime.redis_io.streams import DeadLetters, SyncDeadLetters
from omni_runtime.redis_io.write_ops import ExpireAt, HashDrop, HashPut
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageOutputMsg
from omni_runtime.worker.actions import Outgoing
from omni_runtime.worker.output import OutputThread
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.redis_server]

KINDS = {"xadd": "entry", "hset": "state", "hdel": "state", "pexpireat": "state",
         "persist": "state", "xack": "ack", "xdel": "ack", "expire": "ack"}  # fmt: skip
"""What each command a batch sends is: the entries come first, then the states that
record them, then what follows both (a dead letter's copy, then its original's removal)."""


class Recorded:
    """A client's pipelines, each one's commands kept when it is executed (one round trip)."""

    def __init__(self) -> None:
        self.round_trips: list[list[str]] = []

    def wrap(self, client: Any) -> None:
        make = client.pipeline

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            return _Pipe(make(*args, **kwargs), self.round_trips)

        client.pipeline = pipeline

    def kinds(self) -> list[list[str]]:
        return [sorted({KINDS[name] for name in trip}) for trip in self.round_trips]


class _Pipe:
    """A pipeline that notes the name of every command queued on it, sync or asyncio."""

    def __init__(self, pipe: Any, log: list[list[str]]) -> None:
        self._pipe, self._log = pipe, log
        self._names: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._pipe, name)
        if name not in KINDS:
            return attr

        def queued(*args: Any, **kwargs: Any) -> Any:
            self._names.append(name)
            return attr(*args, **kwargs)

        return queued

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        self._log.append(self._names)
        self._names = []  # as the pipeline itself starts afresh
        return self._pipe.execute(*args, **kwargs)

    def __enter__(self) -> _Pipe:
        self._pipe.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._pipe.__exit__(*exc)

    async def __aenter__(self) -> _Pipe:
        await self._pipe.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._pipe.__aexit__(*exc)


@pytest.fixture
def sync_cluster(redis_cluster_url: str) -> Iterator[Any]:
    client = sync_client(redis_cluster_url, cluster=True)
    yield client
    client.close()


async def test_the_orchestrator_writer_sends_states_after_entries_and_acks_after_states(
    redis_cluster_url: str, sync_cluster: Any
) -> None:
    client = async_client(redis_cluster_url, cluster=True)
    recorded = Recorded()
    recorded.wrap(client)
    writer = StreamWriter(client, 1000)
    task = asyncio.create_task(writer.run())
    try:
        sync_cluster.xgroup_create("out-stream", "g", id="0", mkstream=True)
        entry_id = sync_cluster.xadd("out-stream", {"p": b"output"})
        sync_cluster.xreadgroup("g", "c", {"out-stream": ">"})
        # Streams and hashes spread over the three nodes, in one batch.
        for i in range(6):
            writer.xadd(f"client-{i}", {"p": b"x"})
        writer.queue(HashPut("states-a", {"r1": b"state"}))
        writer.queue(HashDrop("states-b", ["r0"]))
        writer.queue(ExpireAt("states-a", 4_102_444_800_000))
        writer.xack("out-stream", "g", entry_id, delete=True)
        writer.expire("client-0", 60)
        assert await writer.written()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
    assert recorded.kinds() == [["entry"], ["state"], ["ack"]], recorded.round_trips
    assert sync_cluster.hget("states-a", "r1") == b"state"
    assert sync_cluster.xpending("out-stream", "g")["pending"] == 0
    assert all(sync_cluster.xlen(f"client-{i}") == 1 for i in range(6))


def test_a_worker_acknowledges_its_inputs_once_their_outputs_are_in(
    sync_cluster: Any, redis_cluster_url: str
) -> None:
    client = sync_client(redis_cluster_url, cluster=True)
    recorded = Recorded()
    recorded.wrap(client)
    in_stream = "stage-1-in"
    sync_cluster.xgroup_create(in_stream, keys.WORKERS_GROUP, id="0", mkstream=True)
    taken = sync_cluster.xadd(in_stream, {"p": b"input"})
    sync_cluster.xreadgroup(keys.WORKERS_GROUP, "A", {in_stream: ">"})
    out = OutputThread(
        client,
        "stage-1-out",
        in_stream,
        maxlen=1000,
        backoff=lambda: Backoff(0.01, 0.01, 5),
        on_lost=lambda *_: None,
        metrics=Metrics(),
    )
    final = StageOutputMsg(request_id="r1", data="r1", finished=True, seq=0)
    out.publish([Outgoing("r1", 0, codec.encode_model(final), True, False, taken)], [])
    out.start()
    try:
        wait_until(lambda: sync_cluster.xpending(in_stream, keys.WORKERS_GROUP)["pending"] == 0)
    finally:
        out.request_stop()
        out.join(5)
        client.close()
    assert recorded.kinds() == [["entry"], ["ack"]], recorded.round_trips
    assert sync_cluster.xlen("stage-1-out") == 1


async def test_a_malformed_entry_is_acknowledged_once_its_dead_letter_is_in(
    sync_cluster: Any, redis_cluster_url: str
) -> None:
    aio = async_client(redis_cluster_url, cluster=True)
    sync = sync_client(redis_cluster_url, cluster=True)
    recorded = Recorded()
    for client in (aio, sync):
        recorded.wrap(client)
    sync_cluster.xgroup_create("in", "g", id="0", mkstream=True)
    bad = [sync_cluster.xadd("in", {"junk": b"x"}) for _ in range(2)]
    sync_cluster.xreadgroup("g", "c", {"in": ">"})
    try:
        assert await DeadLetters(aio, "dead").send_all("in", "g", [(bad[0], None, "bad")])
        assert SyncDeadLetters(sync, "dead").send_all("in", "g", [(bad[1], None, "bad")])
    finally:
        await aio.aclose()
        sync.close()
    assert recorded.kinds() == [["entry"], ["ack"]] * 2, recorded.round_trips
    assert sync_cluster.xlen("dead") == 2 and sync_cluster.xlen("in") == 0
    assert sync_cluster.xpending("in", "g")["pending"] == 0
