"""The worker shell's parts around the core: output thread, slots, takeovers (no real Redis)."""

from __future__ import annotations

import threading
from typing import Any, cast

import fakeredis
import pytest
import redis

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io.backoff import RetrySettings
from omni_runtime.redis_io.entries import BacklogCursor, parse_entries
from omni_runtime.redis_io.streams import SyncGroupReader
from omni_runtime.settings import Settings
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageInputMsg, StageOutputMsg
from omni_runtime.wire.views import StageInputView
from omni_runtime.worker import takeover as takeover_module
from omni_runtime.worker.actions import Input, Outgoing
from omni_runtime.worker.io_threads import Slots
from omni_runtime.worker.output import OutputThread
from omni_runtime.worker.takeover import Takeover, TakeoverSettings
from tests.unit.test_worker_core import make, published
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


class FlakyRedis:
    """Enough of a redis client for the output thread: pipelines that fail `failures` times."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.written: list[tuple[str, Any]] = []
        self.lock = threading.Lock()

    def pipeline(self, transaction: bool = False) -> FlakyPipe:
        return FlakyPipe(self)


class FlakyPipe:
    def __init__(self, owner: FlakyRedis) -> None:
        self.owner = owner
        self.ops: list[tuple[str, Any]] = []
        self.commands = 0

    def __enter__(self) -> FlakyPipe:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def xadd(self, stream: str, fields: dict[str, bytes], **_kw: Any) -> None:
        self.commands += 1
        entry = {k.encode(): v for k, v in fields.items()}
        for msg in parse_entries(entry, StageOutputMsg, 1 << 20):  # one round trip's batch
            self.ops.append(("xadd", (msg.request_id, msg.seq, msg.error)))

    def xack(self, stream: str, group: str, *ids: bytes) -> None:
        self.commands += 1
        self.ops.extend(("xack", i) for i in ids)

    def xdel(self, stream: str, *ids: bytes) -> None:
        self.commands += 1
        self.ops.extend(("xdel", i) for i in ids)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        with self.owner.lock:
            if self.owner.failures > 0:
                self.owner.failures -= 1
                raise redis.exceptions.ConnectionError("down")
            self.owner.written.extend(self.ops)
        return [1] * self.commands


def out(rid: str, seq: int, ends: bool = False, error: str | None = None) -> Outgoing:
    msg = StageOutputMsg(request_id=rid, data=None, finished=ends, error=error, seq=seq)
    ack = f"{rid}-in".encode() if ends or error else None
    return Outgoing(rid, seq, codec.encode_model(msg), ends or error is not None, bool(error), ack)


Lost = list[tuple[list[Outgoing], str]]


def output_thread(client: FlakyRedis, lost: Lost, attempts: int) -> OutputThread:
    thread = OutputThread(
        cast("redis.Redis", client),
        "out",
        "in",
        maxlen=100,
        backoff=lambda: RetrySettings(0.001, 0.002, attempts).backoff(bounded=True),
        on_lost=lambda outs, reason: lost.append((outs, reason)),
        metrics=Metrics(),
    )
    thread.start()
    return thread


def test_the_output_thread_retries_a_failed_write_within_its_bound() -> None:
    client, lost = FlakyRedis(failures=2), Lost()
    thread = output_thread(client, lost, attempts=5)
    thread.publish([out("a", 0), out("a", 1, ends=True)], [b"x-in"])
    wait_until(lambda: len(client.written) == 6)
    assert client.written == [
        ("xadd", ("a", 0, None)),
        ("xadd", ("a", 1, None)),
        ("xack", b"a-in"),
        ("xack", b"x-in"),
        ("xdel", b"a-in"),  # handled inputs leave the stream with their acknowledgement
        ("xdel", b"x-in"),
    ]
    assert lost == [] and thread.metrics.value("omni_retries_total") == 2
    thread.request_stop()
    thread.join(5)


def test_an_outage_beyond_the_retries_reports_the_lost_outputs_and_skips_their_rest() -> None:
    client, lost = FlakyRedis(failures=3), Lost()
    thread = output_thread(client, lost, attempts=3)
    thread.publish([out("a", 0), out("b", 0)], [])
    wait_until(lambda: bool(lost))
    ((outs, reason),) = lost
    assert [(o.request_id, o.seq) for o in outs] == [("a", 0), ("b", 0)]
    assert reason == "Redis unreachable after 3 attempts (ConnectionError)"
    assert thread.metrics.value("omni_dropped_writes_total") == 1
    # Redis is back: a's final is skipped (its error output follows), its input still acked
    thread.publish([out("a", 1, ends=True), out("c", 0, ends=True)], [])
    thread.publish([out("a", 2, error="lost"), out("b", 1, error="lost"), out("a", 3)], [])
    thread.request_stop()
    thread.join(5)
    assert [op for op in client.written if op[0] == "xadd"] == [
        ("xadd", ("c", 0, None)),
        ("xadd", ("a", 2, "lost")),
        ("xadd", ("a", 3, None)),  # after its error output: the core never sends that
        ("xadd", ("b", 1, "lost")),  # (a request's outputs go together)
    ]
    assert ("xack", b"a-in") in client.written


def test_slots_bound_what_the_input_thread_may_take() -> None:
    slots = Slots(3)
    assert slots.take_up_to(5, 0.01) == 3
    assert slots.take_up_to(1, 0.01) == 0  # none free: waited, got nothing
    slots.force_take(2)  # a takeover runs beyond the concurrency
    slots.give_back(4)
    assert slots.free == 2 and slots.take_up_to(8, 0.01) == 2


def stage_1_inputs(*request_ids: str) -> tuple[fakeredis.FakeRedis, Settings, str]:
    """A Redis holding one input per request on stage 1's stream, and its workers' group."""
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    settings = Settings(max_deliveries=3)
    stream = settings.names.stage_in(1)
    client.xgroup_create(stream, keys.WORKERS_GROUP, id="0", mkstream=True)
    for rid in request_ids:
        msg = StageInputMsg(request_id=rid, data="x")
        client.xadd(stream, {keys.PAYLOAD_FIELD: codec.encode_model(msg)})
    return client, settings, stream


def first_entry(client: fakeredis.FakeRedis, stream: str) -> bytes:
    entries: Any = client.xrange(stream, count=1)
    return cast(bytes, entries[0][0])


def reader_of(
    client: fakeredis.FakeRedis, settings: Settings, consumer: str
) -> SyncGroupReader[StageInputView]:
    return SyncGroupReader(
        client, settings.names.stage_in(1), keys.WORKERS_GROUP, consumer, StageInputView,
        max_bytes=1 << 20, dead_letters=settings.names.dead_letters, metrics=Metrics(),
    )  # fmt: skip


def takeover_of(
    client: fakeredis.FakeRedis,
    settings: Settings,
    worker_id: str,
    delivered: list[Input],
    replaces: str | None = None,
) -> Takeover:
    return Takeover(
        client, reader_of(client, settings, worker_id), delivered.extend,
        settings.part(TakeoverSettings, retry=settings.part(RetrySettings)),
        worker_id=worker_id, stage_id=1, metrics=Metrics(), replaces=replaces,
    )  # fmt: skip


def test_a_takeover_runs_a_dead_replicas_inputs_but_dead_letters_what_killed_one_alone() -> None:
    """Delivered on its last delivery but one, an input is a suspect that runs alone
    (`isolation.py`); one whose marker says it ran alone when its process died is
    dead-lettered."""
    client, settings, stream = stage_1_inputs("killer", "beside", "once")
    client.xreadgroup(keys.WORKERS_GROUP, "ghost", {stream: ">"}, count=2)  # and died
    for _ in range(2):  # its replicas died on them: delivered 3 times
        client.xreadgroup(keys.WORKERS_GROUP, "ghost", {stream: "0"})
    client.xreadgroup(keys.WORKERS_GROUP, "ghost", {stream: ">"}, count=1)  # "once"
    killer = first_entry(client, stream)
    client.set(settings.names.ran_alone(1, killer), 1)  # it ran alone, then "ghost" died
    delivered: list[Input] = []
    takeover = takeover_of(client, settings, "me", delivered)
    takeover.min_idle_ms = 0  # claimable at once
    takeover()  # "ghost" has no heartbeat
    assert [(i.msg.request_id, i.refused is not None, i.solo) for i in delivered] == [
        ("killer", True, False),  # refused: it is not run at all
        ("beside", False, True),  # only ever beside it: it runs, alone
        ("once", False, False),
    ]
    assert "the last time alone" in (delivered[0].refused or "")
    assert "OMNI_MAX_DELIVERIES=3" in (delivered[0].refused or "")
    assert not client.exists(settings.names.ran_alone(1, killer))
    assert client.xlen(settings.names.dead_letters) == 1
    assert client.xpending(stream, keys.WORKERS_GROUP)["pending"] == 2  # now ours
    assert takeover.metrics.value("omni_takeovers_total") == 3
    core, engine = make()
    core.on_input(delivered[0], now=0)
    actions = core.take_actions()
    ((rid, _seq, _data, finished, error),) = published(actions)
    assert rid == "killer" and finished and error == delivered[0].refused
    assert engine.queues == {}  # never run


def test_a_replacement_takes_the_replaced_replicas_inputs_while_its_heartbeat_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`serve` starts a process in a dead one's place with `--replaces`: it need not wait
    for the dead one's heartbeat to expire, nor for the TTL's idle fence; another replica
    still waits for both."""
    client, settings, stream = stage_1_inputs("r")
    client.xreadgroup(keys.WORKERS_GROUP, "dead", {stream: ">"})
    heartbeat = settings.names.stage_heartbeat(1, "dead")
    client.set(heartbeat, "{}", px=settings.heartbeat_ttl_ms)
    by_peer: list[Input] = []
    takeover_of(client, settings, "peer", by_peer)()
    assert by_peer == []  # "dead" still beats, for all the peer knows
    replacement: list[Input] = []
    new = takeover_of(client, settings, "new", replacement, replaces="dead")
    new.replace()
    assert not client.exists(heartbeat)  # no live worker in `status`
    assert replacement == []  # delivered under REPLACED_MIN_IDLE_MS ago
    monkeypatch.setattr(takeover_module, "REPLACED_MIN_IDLE_MS", 0)
    client.set(heartbeat, "{}", px=settings.heartbeat_ttl_ms)
    new()  # at a heartbeat
    assert [(i.msg.request_id, i.taken_over) for i in replacement] == [("r", True)]
    assert client.xpending_range(stream, keys.WORKERS_GROUP, "-", "+", 10)[0]["consumer"] == b"new"


def test_a_worker_started_again_under_its_name_dead_letters_what_killed_each_life() -> None:
    """A worker that keeps its consumer name (`--worker-id` in a systemd unit, a pod's
    container restarted in place) reads its own backlog first: an input it was given in
    `OMNI_MAX_DELIVERIES` lives already, the last time alone, is dead-lettered, not run to
    kill this one too."""
    client, settings, stream = stage_1_inputs("killer", "innocent")
    names = settings.names
    client.xreadgroup(keys.WORKERS_GROUP, "w", {stream: ">"}, count=1)  # life 1: "killer"
    for _life in (2, 3):
        client.xreadgroup(keys.WORKERS_GROUP, "w", {stream: "0"})  # its backlog, then died
    client.xreadgroup(keys.WORKERS_GROUP, "w", {stream: ">"}, count=1)  # "innocent", died
    client.set(names.ran_alone(1, first_entry(client, stream)), 1)  # life 3 ran it alone
    takeover = takeover_of(client, settings, "w", [])
    takeover.redelivery.remember_previous_life("w")  # as life 4 starts
    life_4 = reader_of(client, settings, "w")
    assert life_4.cursor.in_backlog
    inputs = takeover.redelivery.backlog(life_4.read(10, 10))
    assert [(i.msg.request_id, i.refused is not None) for i in inputs] == [
        ("killer", True),
        ("innocent", False),
    ]
    assert "delivered 3 times without finishing" in (inputs[0].refused or "")
    letters: Any = client.xrange(names.dead_letters)
    (letter,) = letters
    assert letter[1][b"stream"] == stream.encode() and letter[1][b"raw"]  # its payload kept
    pending = client.xpending_range(stream, keys.WORKERS_GROUP, "-", "+", 10)
    assert [p["message_id"] for p in pending] == [inputs[1].entry_id]  # the killer acked
    for _failed_read in range(3):  # each read failure walks the backlog again: what runs
        life_4.cursor = BacklogCursor(True)  # here is delivered again, but counted only once
        again = takeover.redelivery.backlog(life_4.read(10, 10))
        assert [(i.msg.request_id, i.refused) for i in again] == [("innocent", None)]
    assert client.xlen(names.dead_letters) == 1
