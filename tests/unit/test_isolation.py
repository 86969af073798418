"""`worker/isolation.py`: suspects (inputs delivered again often enough) run one at a time,
each alone and marked while it runs; what comes meanwhile waits; the reader is paused."""

from __future__ import annotations

import fakeredis

from omni_runtime.observe.metrics import Metrics
from omni_runtime.settings import Settings
from omni_runtime.wire.messages import StageInputMsg
from omni_runtime.worker.actions import Input
from omni_runtime.worker.io_threads import Slots
from omni_runtime.worker.isolation import Isolation
from omni_runtime.worker.redelivery import is_suspect

NAMES = Settings().names


def given(rid: str, entry: int, solo: bool = False) -> Input:
    return Input(f"{entry}-0".encode(), StageInputMsg(request_id=rid, data="x"), solo=solo)


def rids(inputs: list[Input]) -> list[str]:
    return [i.msg.request_id for i in inputs]


def test_suspects_run_one_at_a_time_each_alone_and_marked_while_it_runs() -> None:
    client = fakeredis.FakeRedis()
    slots = Slots(8)
    isolation = Isolation(client, NAMES, slots, 1, Metrics())

    def marked(entry: int) -> bool:
        return bool(client.exists(NAMES.ran_alone(1, f"{entry}-0".encode())))

    assert rids(isolation.admit([given("plain", 1)], in_flight=0)) == ["plain"]  # nothing held
    batch = [given("s1", 2, solo=True), given("n1", 3), given("s2", 4, solo=True)]
    assert rids(isolation.admit(batch, in_flight=1)) == ["n1"]  # read with them: it goes first
    assert slots.take_up_to(1, 0) == 0  # the reader reads nothing meanwhile
    assert rids(isolation.admit([], in_flight=1)) == []  # "plain" and "n1" run
    assert rids(isolation.admit([], in_flight=0)) == ["s1"]
    assert marked(2) and not marked(4)
    # what a takeover claimed is read again from the backlog, plain: not run beside s1
    again = [given("s1", 2), given("s2", 4), given("s2", 4, solo=True)]
    free = slots.free
    assert rids(isolation.admit([given("late", 5), *again], in_flight=1)) == []  # late waits
    assert slots.free == free + 3  # the copies' slots are given back
    assert isolation.held() == [b"5-0"]
    assert rids(isolation.admit([], in_flight=0)) == ["s2"]  # s1 ended: it killed nobody
    assert not marked(2) and marked(4)
    assert rids(isolation.admit([], in_flight=0)) == ["late"]  # the wait is over
    assert not marked(4) and not isolation.active
    assert isolation.metrics.value("omni_inputs_run_alone_total") == 2
    assert slots.take_up_to(1, 0) == 1


def test_a_suspect_that_cannot_be_marked_waits() -> None:
    """Unmarked, its death would blame nobody: it runs once the marker is written."""
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    isolation = Isolation(client, NAMES, Slots(4), 1, Metrics())
    server.connected = False
    assert isolation.admit([given("s", 1, solo=True)], in_flight=0) == []
    server.connected = True
    assert rids(isolation.admit([], in_flight=0)) == ["s"]
    assert client.exists(NAMES.ran_alone(1, b"1-0"))


def test_a_suspect_is_an_input_on_its_last_delivery_but_one() -> None:
    assert [is_suspect(t, 3) for t in range(4)] == [False, False, True, True]
    assert [is_suspect(t, 1) for t in range(3)] == [False, True, True]  # redelivered at all
    assert [is_suspect(t, 2) for t in range(3)] == [False, True, True]
