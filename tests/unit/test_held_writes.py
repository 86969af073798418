"""What becomes of writes Redis refused: sorting a round trip's replies, holding the
writes refused for memory (`HeldWrites`), and how a batch says which ops each command
carries."""

from __future__ import annotations

from typing import Any

from redis.exceptions import (
    ClusterDownError,
    MovedError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from omni_runtime import keys
from omni_runtime.redis_io.held_writes import PROBE_MAX_S, HeldWrites
from omni_runtime.redis_io.refusals import Refusal, oom_message, refusal, sort_replies
from omni_runtime.redis_io.write_ops import (
    ExpireAt,
    HashDrop,
    HashPut,
    Op,
    XAck,
    XAdd,
    fill_pipeline,
    first_wave,
)
from omni_runtime.wire import codec

OOM = OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")


class Recording:
    """A pipeline that records the commands it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kw: self.calls.append((name, *args, *kw.values()))


def add(stream: str, rid: str, seq: int = 0, merge: int = 0) -> XAdd:
    msg = codec.encode({"type": "orch_output", "request_id": rid, "seq": seq})
    return XAdd(stream, {keys.PAYLOAD_FIELD: msg}, 10, merge_up_to=merge, owner=rid)


def test_refusals_are_told_apart_by_what_redis_said() -> None:
    assert refusal(OOM) is Refusal.OUT_OF_MEMORY
    assert refusal(ResponseError("OOM command not allowed")) is Refusal.OUT_OF_MEMORY
    assert refusal(ReadOnlyError("You can't write against a read only replica.")) is (
        Refusal.TRANSIENT
    )
    assert refusal(ResponseError("LOADING Redis is loading")) is Refusal.TRANSIENT
    assert refusal(ResponseError("ERR invalid expire time")) is Refusal.PERMANENT
    # A cluster pipeline's command whose node died, or moved while it failed over.
    assert refusal(RedisConnectionError("Connection reset by peer")) is Refusal.TRANSIENT
    assert refusal(RedisTimeoutError("Timeout reading from socket")) is Refusal.TRANSIENT
    assert refusal(ClusterDownError("CLUSTERDOWN The cluster is down")) is Refusal.TRANSIENT
    assert refusal(MovedError("3999 127.0.0.1:6381")) is Refusal.TRANSIENT
    assert oom_message(OOM).startswith("Redis is out of memory: it refuses writes")


def test_each_command_carries_the_ops_it_was_built_from() -> None:
    ack = XAck("in", "g", b"1-0", delete=True)
    a, b, other = (
        add("client", "a", merge=1 << 20),
        add("client", "b", merge=1 << 20),
        add("s", "c"),
    )
    expiry = ExpireAt("states", 5, owner="a")
    pipe = Recording()
    carried = fill_pipeline(pipe, [a, ack, other, b, HashPut("states", {"a": b"1"}), expiry])
    assert [c[0] for c in pipe.calls] == ["xadd", "xadd", "hset", "pexpireat", "xack", "xdel"]
    assert carried[0] == [a, b] and carried[1] == [other]  # one entry for the client's two
    assert carried[2] == [HashPut("states", {"a": b"1"})] and carried[3] == [expiry]
    assert carried[4] == [ack] and carried[5] == [ack]


def test_a_hashs_later_op_on_a_field_wins_so_a_state_written_again_never_overwrites() -> None:
    pipe = Recording()
    fill_pipeline(
        pipe,
        [
            HashPut("h", {"r1": b"old", "r2": b"x"}),  # held from before, written again
            HashPut("h", {"r1": b"new"}),
            HashDrop("h", ["r2"]),
        ],
    )
    assert pipe.calls == [("hset", "h", {"r1": b"new"}), ("hdel", "h", "r2")]


def test_an_op_two_commands_carry_takes_the_worse_reply() -> None:
    ack = XAck("in", "g", b"1-0", delete=True)
    a, b = add("s", "a"), add("t", "b")
    replies = sort_replies([OOM, b"1-1", 1, ResponseError("ERR no")], [[a], [b], [ack], [ack]])
    assert replies.written == [b] and replies.needed_memory
    assert replies.out_of_memory == [([a], OOM)]
    assert [ops for ops, _e in replies.failed] == [[ack]]


def test_a_refused_write_is_tried_again_alone_then_the_rest_once_one_passes() -> None:
    held = HeldWrites(0.01, max_hold_s=30)
    first, second = add("in", "a"), add("in", "b")
    assert held.hold([first, second], now=0.0) == []
    due = held.due_at
    assert due is not None and 0 < due <= PROBE_MAX_S
    assert held.take([], now=0.0) == []  # not yet
    assert held.take([], now=due) == [first]  # a probe: the oldest alone
    held.hold([first], now=due)  # refused again: the next wait is longer
    later = held.due_at
    assert later is not None and later - due > due
    assert held.take([], now=later) == [first]
    held.room(now=later)  # it went through: the rest at once
    assert held.take([], now=later) == [second] and len(held) == 0


def test_a_requests_outputs_share_one_entry_and_never_straddle_two() -> None:
    """Greedy batching in arrival order would cut a's outputs across two entries, which
    Redis short of memory could write out of order; a request's outputs go whole."""
    size = len(add("client", "a", 0, 1).fields[keys.PAYLOAD_FIELD])
    bound = 3 * size + 8
    order = [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    a0, b0, a1, b1 = (add("client", rid, seq, bound) for rid, seq in order)
    pipe = Recording()
    carried = fill_pipeline(pipe, [a0, b0, a1, b1])
    assert carried == [[a0, a1], [b0, b1]]


def test_a_requests_second_entry_on_a_stream_waits_for_the_next_round_trip() -> None:
    """Its outputs past an entry's bound, or two entries where none merge: the rest, and
    every op that is not an entry (never ahead of what it follows), go in the next trip."""
    size = len(add("client", "a", 0, 1).fields[keys.PAYLOAD_FIELD])
    bound = 2 * size + 8
    a = [add("client", "a", seq, bound) for seq in range(3)]
    b0, ack = add("client", "b", 0, bound), XAck("stage-out", "g", b"1-0")
    in0, in1 = add("stage-in", "a", 0), add("stage-in", "a", 1)
    batch: list[Op] = [a[0], b0, a[1], ack, a[2], in0, in1]
    now, later = first_wave(batch)
    assert now == [a[0], b0, a[1], in0]
    assert later == [ack, a[2], in1]
    assert first_wave(later[1:]) == (later[1:], [])
    ops: list[Op] = [a[0], b0, ack]
    assert first_wave(ops)[0] is ops  # the usual batch: as it is


def test_later_writes_of_a_request_wait_behind_its_held_one_others_go() -> None:
    held = HeldWrites(0.01, max_hold_s=30)
    a0, a1, b0 = add("client", "a", 0), add("client", "a", 1), add("client", "b", 0)
    held.hold([a0], now=0.0)
    assert held.take([a1, b0], now=0.0) == [b0]
    held.room(now=0.0)
    assert held.take([], now=0.0) == [a0]  # one at a time: a1 cannot pass it in the trip
    held.room(now=0.0)
    assert held.take([], now=0.0) == [a1] and len(held) == 0


def test_held_client_outputs_go_again_as_one_entry_per_request() -> None:
    """A smaller command gets through sooner: Redis counts its own bytes against the room."""
    held = HeldWrites(0.01, max_hold_s=30)
    merge = 1 << 20
    ops = [add("client", "a", 0, merge), add("client", "b", 0, merge), add("client", "a", 1, merge)]
    held.hold(list(ops), now=0.0)
    held.room(now=0.0)
    out = held.take([], now=0.0)
    assert [(op.owner, op.merge_up_to) for op in out if isinstance(op, XAdd)] == [
        ("a", 0),
        ("b", 0),
    ]
    first = out[0]
    assert isinstance(first, XAdd)
    batch = codec.decode(first.fields[keys.PAYLOAD_FIELD])
    assert [m["seq"] for m in batch] == [0, 1]


def test_a_requests_outputs_held_through_a_long_refusal_stay_within_an_entrys_bound() -> None:
    """However many outputs were held, no entry outgrows what the client reads (its
    `max_message_bytes`); the entries go one at a time, in order."""
    held = HeldWrites(0.01, max_hold_s=30)
    bound = 200
    ops = [add("client", "a", seq, bound) for seq in range(12)]
    size = len(ops[0].fields[keys.PAYLOAD_FIELD])
    held.hold(list(ops), now=0.0)
    seqs: list[int] = []
    entries = 0
    while len(held):
        held.room(now=0.0)
        (entry,) = held.take([], now=0.0)
        assert isinstance(entry, XAdd) and entry.merge_up_to == 0
        payload = entry.fields[keys.PAYLOAD_FIELD]
        assert len(payload) <= bound
        batch = codec.decode(payload)
        seqs.extend(m["seq"] for m in (batch if isinstance(batch, list) else [batch]))
        entries += 1
    assert seqs == list(range(12))
    assert entries == -(-12 * size // (bound - 3)) > 1  # as full as the bound allows


def test_a_newer_state_supersedes_the_held_one_and_an_end_frees_it_at_once() -> None:
    held = HeldWrites(0.01, max_hold_s=30)
    held.hold([HashPut("states", {"a": b"old", "b": b"old"})], now=0.0)
    drop = HashDrop("states", ["a"])
    newer = HashPut("states", {"b": b"new"})
    assert held.take([drop, newer], now=0.0) == [drop, newer]  # never behind: HDEL frees
    assert len(held) == 0  # nothing left of the held state
    expiry = ExpireAt("states", 99)
    held.hold([HashPut("states", {"c": b"x"})], now=0.0)
    assert held.take([expiry], now=0.0) == []  # after the state that makes the hash


def test_a_write_held_too_long_is_given_up_with_its_requests_other_writes() -> None:
    held = HeldWrites(0.01, max_hold_s=5)
    a0, a1, b0 = add("client", "a", 0), add("client", "a", 1), add("client", "b", 0)
    assert held.hold([a0], now=0.0) == []
    held.take([a1], now=0.0)  # behind a0
    held.hold([b0], now=4.0)
    gone = held.hold([], now=5.0)
    assert gone == [a0, a1] and len(held) == 1


def test_a_stopping_writer_takes_every_held_write_back() -> None:
    held = HeldWrites(0.01, max_hold_s=5)
    ops: list[Op] = [add("s", "a"), add("s", "b")]
    held.hold(list(ops), now=0.0)
    assert held.drain() == ops and held.due_at is None
