"""The writer's typed operations, and how one batch of them becomes one pipeline.

Pure: builds commands on a pipeline it is given, never sends them (`writer` does).
The ops are slotted dataclasses, not frozen ones: a frozen `__init__` sets each field
through `object.__setattr__` (several times slower) and the orchestrator makes several
per request. Nothing changes an op once it is queued (`replace` copies).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, cast

from redis.typing import EncodableT, FieldT

from omni_runtime import keys
from omni_runtime.wire import codec

PAYLOAD = keys.PAYLOAD_FIELD


def xadd_fields(fields: dict[str, Any]) -> dict[FieldT, EncodableT]:
    """`fields`, unchanged, as the type redis-py's `xadd` declares.

    The stub asks for a `dict[FieldT, EncodableT]`; dict is invariant, so it rejects our
    `dict[str, ...]` although every str key is a `FieldT` and xadd only reads the items.
    """
    return cast("dict[FieldT, EncodableT]", fields)


@dataclass(slots=True)
class XAdd:
    stream: str
    fields: dict[str, Any]
    maxlen: int
    urgent: bool = False
    max_age_s: float | None = None
    """Trim by age instead (MINID): for a broadcast stream no group acknowledges."""
    merge_up_to: int = 0
    """If > 0: may share one entry (a batch, `codec.encode_batch`) with the next ones of
    its stream in the same pipeline, up to this many payload bytes. For a stream whose
    reader takes batches and acknowledges nothing (a client's)."""
    owner: str | None = None
    """The request the entry belongs to: if Redis refuses it for good, that request fails."""


@dataclass(slots=True)
class XAck:
    stream: str
    group: str
    entry_id: bytes
    delete: bool = False
    """XDEL the entry right after its XACK: a handled entry is never read again, so it
    need not stay in memory until MAXLEN trims it."""


@dataclass(slots=True)
class XDel:
    """XDEL entries of a stream no group reads (a client's, once it read them)."""

    stream: str
    entry_ids: list[bytes]


@dataclass(slots=True)
class Expire:
    key: str
    ttl_s: int


@dataclass(slots=True)
class HashPut:
    """HSET every field of `fields` into hash `key`: many requests' states, one command."""

    key: str
    fields: dict[str | bytes, bytes]


@dataclass(slots=True)
class HashDrop:
    """HDEL `fields` from hash `key` (the hash goes with its last field)."""

    key: str
    fields: list[str | bytes]


@dataclass(slots=True)
class ExpireAt:
    """PEXPIREAT `key` `at_ms`, or PERSIST it when `at_ms` is None."""

    key: str
    at_ms: int | None
    owner: str | None = None
    """The request whose deadline asked for this expiry: if Redis refuses it, that request
    fails (an expiry out of Redis's range)."""


Op = XAdd | XAck | XDel | Expire | HashPut | HashDrop | ExpireAt


def owners(op: Op) -> list[str]:
    """The requests a write belongs to: a write Redis refuses for good fails them."""
    if isinstance(op, XAdd | ExpireAt):
        return [] if op.owner is None else [op.owner]
    if isinstance(op, HashPut):  # a state's field is its request id (its chunks', bytes)
        return [f for f in op.fields if isinstance(f, str)]
    return []


def fill_pipeline(pipe: Any, ops: list[Op]) -> list[list[Op]]:
    """The XADDs in order, urgent ones last; then each hash's states (one HSET, one HDEL,
    its expiry); then one XACK per stream with all its ids (and one XDEL of those to
    delete) and one EXPIRE per key, after the writes they follow (never an ack before its
    consequences). Returns, per command queued, the ops it carries: what to write again
    if that command alone fails.

    Urgent last, because Redis answers the readers a pipeline wakes last-woken first (its
    list of clients to write to is pushed at the head): of two readers blocked on streams
    one pipeline XADDs to, the second stream's reader has its entry first; of three, the
    last stream's reader is answered first and the first's last (docs/performance.md). Urgent entries keep the order they were
    queued in, so the last queued is answered first: a streaming request's inputs are
    submitted downstream first, and stage 0's, whose first token the user waits for, is
    heard first. Only XADDs wake readers; the rest answer this process alone.

    A hash's ops are coalesced, the later winning per field: a state refused once (Redis
    out of memory) and written again with newer ones can never overwrite them."""
    carried: list[list[Op]] = []
    groups = merged_groups([op for op in ops if isinstance(op, XAdd)])
    for add, parts in sorted(groups, key=lambda g: g[0].urgent):  # stable: order kept otherwise
        if add.max_age_s is None:
            pipe.xadd(add.stream, xadd_fields(add.fields), maxlen=add.maxlen, approximate=True)
        else:
            minid = int((time.time() - add.max_age_s) * 1000)
            pipe.xadd(add.stream, xadd_fields(add.fields), minid=minid, approximate=False)
        carried.append(list(parts))
    for key, h in _hashes(ops).items():
        if h.put:  # carries itself, coalesced: written again, it is exactly this command
            pipe.hset(key, mapping=h.put)
            carried.append([HashPut(key, h.put)])
        if h.drop:
            pipe.hdel(key, *h.drop)
            carried.append([HashDrop(key, list(h.drop))])
        if h.expiry is not None:
            if h.expiry.at_ms is None:
                pipe.persist(key)
            else:
                pipe.pexpireat(key, h.expiry.at_ms)
            carried.append([h.expiry])
    acks: dict[tuple[str, str], tuple[list[bytes], list[Op]]] = {}
    deletes: dict[str, tuple[list[bytes], list[Op]]] = {}
    expires: dict[str, tuple[int, list[Op]]] = {}
    for op in ops:
        if isinstance(op, XAck):
            _add(acks, (op.stream, op.group), [op.entry_id], op)
            if op.delete:
                _add(deletes, op.stream, [op.entry_id], op)
        elif isinstance(op, XDel):
            _add(deletes, op.stream, op.entry_ids, op)
        elif isinstance(op, Expire):
            ttl_s, them = expires.get(op.key, (0, []))
            expires[op.key] = (max(op.ttl_s, ttl_s), [*them, op])
    for (stream, group), (ids, them) in acks.items():
        pipe.xack(stream, group, *ids)
        carried.append(them)
    for stream, (ids, them) in deletes.items():
        pipe.xdel(stream, *ids)
        carried.append(them)
    for key, (ttl_s, them) in expires.items():
        pipe.expire(key, ttl_s)
        carried.append(them)
    return carried


def phases(ops: list[Op]) -> list[list[Op]]:
    """`ops` in the groups `fill_pipeline` orders, each depending on the one before: the
    entries; the request states that record them; the acknowledgements, deletions and
    expiries that follow both. One pipeline keeps that order on a single Redis. A
    cluster's sends each node its commands at once, in no order across nodes: a state
    could land before the entry it records, and a process killed between two nodes'
    writes loses that entry (a request's final) for good. There each group is a round
    trip of its own, sent once the one before was answered (`packed_async`)."""
    states = HashPut | HashDrop | ExpireAt
    adds: list[Op] = [op for op in ops if isinstance(op, XAdd)]
    hashes: list[Op] = [op for op in ops if isinstance(op, states)]
    rest: list[Op] = [op for op in ops if not isinstance(op, XAdd | states)]
    return [group for group in (adds, hashes, rest) if group]


def _add(into: dict[Any, tuple[list[bytes], list[Op]]], key: Any, ids: list[bytes], op: Op) -> None:
    got = into.setdefault(key, ([], []))
    got[0].extend(ids)
    got[1].append(op)


@dataclass(slots=True)
class _Hash:
    """One hash's ops of a batch, coalesced: fields to set and to delete (disjoint, the
    later op on a field winning), the last expiry asked for."""

    put: dict[str | bytes, bytes]
    drop: dict[str | bytes, None]
    expiry: ExpireAt | None = None


def _hashes(ops: list[Op]) -> dict[str, _Hash]:
    """Per hash, in order of first use."""
    out: dict[str, _Hash] = {}
    for op in ops:
        if not isinstance(op, HashPut | HashDrop | ExpireAt):
            continue
        h = out.get(op.key)
        if h is None:
            h = out[op.key] = _Hash({}, {})
        if isinstance(op, HashPut):
            h.put.update(op.fields)
            for f in op.fields:
                h.drop.pop(f, None)
        elif isinstance(op, HashDrop):
            for f in op.fields:
                h.put.pop(f, None)
                h.drop[f] = None
        else:
            h.expiry = op
    return out


def merged(adds: list[XAdd]) -> list[XAdd]:
    """`adds` with each stream's mergeable entries gathered into batch entries, in order,
    each at most `merge_up_to` payload bytes, where the stream's first one was: a client
    that gets the outputs of many requests costs one XADD per round trip, not one each.
    (A stream's entries are either all mergeable or none.)"""
    return [add for add, _parts in merged_groups(adds)]


def merged_groups(adds: list[XAdd]) -> list[tuple[XAdd, list[XAdd]]]:
    """`merged`, each entry with the adds it carries."""
    order: list[XAdd | str] = []
    mergeable: dict[str, list[XAdd]] = {}
    for add in adds:
        if not add.merge_up_to:
            order.append(add)
        elif add.stream in mergeable:
            mergeable[add.stream].append(add)
        else:
            mergeable[add.stream] = [add]
            order.append(add.stream)
    out: list[tuple[XAdd, list[XAdd]]] = []
    for item in order:
        if isinstance(item, XAdd):
            out.append((item, [item]))
            continue
        group = mergeable[item]
        first = group[0]
        for parts in codec.batches(group, payload_bytes, first.merge_up_to, _owner):
            payloads = [add.fields[PAYLOAD] for add in parts]
            payload = payloads[0] if len(parts) == 1 else codec.encode_batch(payloads)
            out.append((replace(first, fields={PAYLOAD: payload}, merge_up_to=0), parts))
    return out


def payload_bytes(add: XAdd) -> int:
    """What an entry's payload weighs against its stream's merge bound."""
    return len(add.fields[PAYLOAD])


def _owner(add: XAdd) -> str | None:
    return add.owner


def first_wave(ops: list[Op]) -> tuple[list[Op], list[Op]]:
    """(what one round trip carries, what waits for the next): at most one entry of a
    request on a stream per round trip.

    Redis short of memory refuses a command bigger than the room it has left (its own
    bytes count) and runs a smaller one after it in the same pipeline: a request's two
    entries on one stream could be written out of order, which its reader takes for a
    gap (a client) or a repeat (an orchestrator). So a request's entries past its first
    on a stream wait for the next round trip, and every op that is not an entry waits
    with them (an acknowledgement or a state never goes ahead of the entries it follows).
    Rare: a request's outputs past a batch's bound in one round trip (`codec.batches`
    keeps the rest of a request's outputs in one entry), or two entries of one request
    on a stream that takes no batches."""
    firsts: set[tuple[str, str]] = set()
    mergeable: dict[tuple[str, str], list[XAdd]] = {}
    later: set[int] = set()
    for op in ops:
        if type(op) is not XAdd or op.owner is None:
            continue
        key = (op.stream, op.owner)
        if op.merge_up_to:
            mergeable.setdefault(key, []).append(op)
        elif key in firsts:
            later.add(id(op))
        else:
            firsts.add(key)
    for group in mergeable.values():
        if len(group) > 1:
            for part in codec.batches(group, payload_bytes, group[0].merge_up_to)[1:]:
                later.update(map(id, part))
    if not later:
        return ops, []
    now: list[Op] = [op for op in ops if type(op) is XAdd and id(op) not in later]
    return now, [op for op in ops if type(op) is not XAdd or id(op) in later]
