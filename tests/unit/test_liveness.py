"""Absences timed by the observer, stage watch, run_id watch, outbox numbering, XDEL on ack."""

from __future__ import annotations

import fakeredis
import pytest

from omni_runtime import keys
from omni_runtime.core.types import OrchOutput
from omni_runtime.orchestrator.outbox import ClientOutbox
from omni_runtime.redis_io.entries import parse_entries
from omni_runtime.redis_io.liveness import Absence, StageWatch, StateEpoch
from omni_runtime.redis_io.streams import stream_reply
from omni_runtime.redis_io.write_ops import XAck, fill_pipeline
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire.messages import OrchOutputMsg


def test_absence_is_gone_only_after_a_whole_ttl_missing() -> None:
    a = Absence(5.0)
    assert a.update({"c": False}, 100.0) == set()  # first sight: not gone
    assert a.update({"c": False}, 104.9) == set()
    assert a.update({"c": True}, 105.0) == set()  # back: forgotten
    assert a.update({"c": False}, 106.0) == set()
    assert a.update({"c": False}, 111.0) == {"c"}
    assert a.update({}, 112.0) == set() and len(a) == 0  # no longer watched: forgotten


def test_stage_watch_is_quiet_for_one_ttl_after_a_restart() -> None:
    w = StageWatch(5.0, 0.0)
    assert w.update([(0, False)], 1.0) == (set(), set())
    assert w.update([(0, False), (1, True)], 5.0) == ({0}, set())
    assert w.update([(0, False)], 6.0) == (set(), set())
    assert w.update([(0, True)], 7.0) == (set(), {0})
    w.restarted(8.0)
    assert w.update([(0, False)], 12.0) == (set(), set())


async def test_state_epoch_sees_redis_losing_its_data_once_per_process() -> None:
    server = fakeredis.FakeServer()
    a = StateEpoch(fakeredis.FakeAsyncRedis(server=server), "ns:hb:epoch")
    b = StateEpoch(fakeredis.FakeAsyncRedis(server=server), "ns:hb:epoch")
    assert not await a.lost() and not await b.lost()
    assert not await a.lost()  # a restart that kept the data (AOF) loses nothing
    await a.client.flushall()
    assert await b.lost() and await a.lost()  # b wrote the new token, a sees it differ
    assert not await a.lost() and not await b.lost()


async def test_outbox_numbers_each_requests_outputs_from_0() -> None:
    r = fakeredis.FakeAsyncRedis()
    writer = StreamWriter(r, 1000)
    names = keys.Names("t")
    box = ClientOutbox(writer, names, 60, 1 << 20)
    box.client_of.update({"a": "c1", "b": "c1"})
    for o in [
        OrchOutput("a", 0, 1, False),
        OrchOutput("b", 0, 1, False),
        OrchOutput("a", 0, 2, True),
        OrchOutput("a", 0, 3, True),  # after its final: no client any more
        OrchOutput("b", 2, None, True, error="x"),
    ]:
        box.send(o)
    box.refuse("z", "c1", "no live worker for stage 1")
    assert len(box) == 0 and box._seq == {}
    await writer._write(writer._ops)
    reply = await r.xread({names.client_out("c1"): "0-0"})
    msgs = [
        msg
        for _s, es in stream_reply(reply)
        for _i, f in es
        for msg in parse_entries(f, OrchOutputMsg, 1 << 20)
    ]
    assert [(m.request_id, m.seq, m.finished) for m in msgs] == [  # a request's together
        ("a", 0, False),
        ("a", 1, True),
        ("b", 0, False),
        ("b", 1, True),
        ("z", 0, True),
    ]


@pytest.mark.parametrize("delete", [False, True])
async def test_an_ack_may_delete_the_entry_in_the_same_pipeline(delete: bool) -> None:
    r = fakeredis.FakeAsyncRedis()
    await r.xgroup_create("s", "g", id="0", mkstream=True)
    entry_id = await r.xadd("s", {"m": b"x"})
    assert isinstance(entry_id, bytes)
    await r.xreadgroup("g", "c", {"s": ">"})
    async with r.pipeline(transaction=False) as pipe:
        fill_pipeline(pipe, [XAck("s", "g", entry_id, delete)])
        await pipe.execute()
    assert await r.xlen("s") == (0 if delete else 1)
    assert (await r.xpending("s", "g"))["pending"] == 0
