"""Fencing a stalled replica: what another replica claimed meanwhile is never published.

The fence, the core's ownership rule and the output thread's drop, on fakeredis with a
real consumer group: replica A reads two inputs, stalls past its TTL, and B claims one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import fakeredis
import pytest
import redis

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageInputMsg, StageOutputMsg
from omni_runtime.worker.actions import Input, Outgoing, Ownership
from omni_runtime.worker.fence import StallFence, StallGuard, read_ownership
from omni_runtime.worker.output import OutputThread
from tests.unit.test_worker_core import make
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)

IN, OUT = "ns:stage:1:in", "ns:stage:1:out"


def test_writes_need_no_check_within_the_window_and_wait_for_one_after_a_stall() -> None:
    fence = StallFence(ttl_s=5.0)
    now = time.monotonic()
    assert not fence.renew(now) and fence.fresh()
    stalled_until = now + 10.0  # the next beat starts well past the TTL
    assert fence.renew(stalled_until)
    assert not fence.fresh() and not fence.wait_writable(0.01)
    fence.confirmed(stalled_until)
    assert fence.fresh()


def test_an_ownership_snapshot_tells_claimed_inputs_from_ones_delivered_after_it() -> None:
    own = Ownership(frozenset({b"5-0"}), frozenset({b"6-0"}), last_delivered=(7, 0))
    assert not own.lost(b"5-0")  # still ours
    assert own.lost(b"6-0")  # pending under another replica
    assert own.lost(b"4-0")  # delivered before, no longer pending: claimed and finished
    assert not own.lost(b"8-0")  # delivered to us after the snapshot


def test_the_core_gives_up_only_claimed_inputs_and_drops_one_that_arrives_late() -> None:
    core, engine = make()
    core.on_input(Input(b"1-0", StageInputMsg(request_id="kept", data=["a"])), 0)
    core.on_input(Input(b"2-0", StageInputMsg(request_id="claimed", data=["b"])), 0)
    core.take_actions()
    own = Ownership(frozenset({b"1-0"}), frozenset({b"2-0", b"3-0"}), last_delivered=(3, 0))
    assert core.on_ownership(own) == ["claimed"]
    actions = core.take_actions()
    assert engine.aborted == ["claimed"] and actions.freed_slots == 1
    assert not actions.outputs and not actions.acks  # not ours to end or acknowledge
    # Read before the stall, handed over after the check: claimed, so never run here ...
    core.on_input(Input(b"3-0", StageInputMsg(request_id="late", data=["c"])), 0)
    # ... unlike one delivered after the snapshot, or one this replica took over since.
    core.on_input(Input(b"9-0", StageInputMsg(request_id="new", data=["d"])), 0)
    core.on_input(Input(b"3-0", StageInputMsg(request_id="mine", data=["e"]), taken_over=True), 0)
    assert [core.is_active(r) for r in ("kept", "claimed", "late", "new", "mine")] == [
        True,
        False,
        False,
        True,
        True,
    ]


def _as_bytes(entry_id: object) -> bytes:
    return entry_id if isinstance(entry_id, bytes) else str(entry_id).encode()


def _final(rid: str, entry: bytes) -> Outgoing:
    msg = StageOutputMsg(request_id=rid, data=rid, finished=True, seq=0)
    return Outgoing(rid, 0, codec.encode_model(msg), True, False, entry)


def _read_by_a() -> tuple[fakeredis.FakeRedis, bytes, bytes]:
    """Two inputs, `mine` and `taken`, both read by replica A."""
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    client.xgroup_create(IN, keys.WORKERS_GROUP, id="0", mkstream=True)
    mine, taken = (
        _as_bytes(client.xadd(IN, {keys.PAYLOAD_FIELD: codec.encode_model(msg)}))
        for msg in (StageInputMsg(request_id=r, data=r) for r in ("mine", "taken"))
    )
    client.xreadgroup(keys.WORKERS_GROUP, "A", {IN: ">"}, count=2)
    return client, mine, taken


def _output_thread(client: fakeredis.FakeRedis, guard: StallGuard) -> tuple[OutputThread, Metrics]:
    metrics = Metrics()
    out = OutputThread(
        client,
        OUT,
        IN,
        maxlen=1000,
        backoff=lambda: Backoff(0.01, 0.01, 5),
        on_lost=lambda *_: None,
        metrics=metrics,
        fence=guard.fence,
    )
    return out, metrics


def test_a_bare_acknowledgement_of_an_input_claimed_meanwhile_is_not_sent() -> None:
    client, mine, taken = _read_by_a()
    client.xclaim(IN, keys.WORKERS_GROUP, "B", min_idle_time=0, message_ids=[taken])
    guard = StallGuard(client, IN, "A", ttl_s=5.0, wake=threading.Event())
    out, _metrics = _output_thread(client, guard)
    guard.after_beat(time.monotonic() + 10.0)
    out.publish([_final("mine", mine)], [taken])  # `taken` ended here with no output
    out.start()
    assert guard.apply(lambda ownership: [], out.forget)
    out.request_stop()
    out.join(5)
    pending: Any = client.xpending(IN, keys.WORKERS_GROUP)
    assert client.xlen(OUT) == 1 and pending["pending"] == 1  # B's: still pending


def test_a_stalled_replica_publishes_nothing_for_an_input_another_replica_claimed() -> None:
    client, mine, taken = _read_by_a()
    client.xclaim(IN, keys.WORKERS_GROUP, "B", min_idle_time=0, message_ids=[taken])
    own = read_ownership(client, IN, "A")
    assert (own.mine, own.others) == (frozenset({mine}), frozenset({taken}))

    guard = StallGuard(client, IN, "A", ttl_s=5.0, wake=threading.Event())
    out, metrics = _output_thread(client, guard)
    guard.after_beat(time.monotonic() + 10.0)  # A's first beat after a stall: ownership read
    out.publish([_final("mine", mine), _final("taken", taken)], [])
    out.start()
    assert not guard.fence.wait_writable(0.2) and client.xlen(OUT) == 0
    assert guard.apply(lambda ownership: [], out.forget)
    out.request_stop()  # writes what is still queued, then exits
    out.join(5)
    entries: Any = client.xrange(OUT)
    published = [codec.decode(fields[keys.PAYLOAD_FIELD.encode()]) for _, fields in entries]
    assert [m["request_id"] for m in published] == ["mine"]
    assert metrics.value("omni_fenced_outputs_total") == 1
    pending: Any = client.xpending(IN, keys.WORKERS_GROUP)
    assert pending["pending"] == 1  # B's claimed entry: A did not acknowledge it


def test_a_write_that_failed_across_a_stall_leaves_out_what_was_claimed_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch passed its fence, then the replica stalled: another replica claimed one of
    its inputs and closed its connections, so the write failed. Written again once the
    ownership check is through, it holds only what is still this replica's."""
    client, mine, taken = _read_by_a()
    guard = StallGuard(client, IN, "A", ttl_s=5.0, wake=threading.Event())
    out, metrics = _output_thread(client, guard)
    written = out._round_trip
    stalled = threading.Event()

    def across_a_stall(batch: Any) -> list[object]:
        if stalled.is_set():
            return written(batch)
        client.xclaim(IN, keys.WORKERS_GROUP, "B", min_idle_time=0, message_ids=[taken])
        guard.after_beat(time.monotonic() + 10.0)  # the first beat after it: ownership read
        stalled.set()
        raise redis.ConnectionError("closed by the replica that claimed the input")

    monkeypatch.setattr(out, "_round_trip", across_a_stall)
    out.publish([_final("mine", mine), _final("taken", taken)], [])
    out.start()
    assert stalled.wait(5)
    assert not guard.fence.wait_writable(0.2) and client.xlen(OUT) == 0  # held meanwhile
    assert guard.apply(lambda ownership: [], out.forget)
    wait_until(lambda: client.xlen(OUT) > 0, deadline_s=5)
    out.request_stop()
    out.join(5)
    entries: Any = client.xrange(OUT)
    published = [codec.decode(fields[keys.PAYLOAD_FIELD.encode()]) for _, fields in entries]
    assert [m["request_id"] for m in published] == ["mine"]
    assert metrics.value("omni_fenced_outputs_total") == 1
    assert metrics.value("omni_deposed_requests_total") == 1
    pending: Any = client.xpending(IN, keys.WORKERS_GROUP)
    assert pending["pending"] == 1  # B's claimed entry: A did not acknowledge it
