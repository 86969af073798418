"""The writer's typed operations, and how one batch of them becomes one pipeline.

Pure: builds commands on a pipeline it is given, never sends them (`writer` does).
The ops are slotted dataclasses, not frozen ones: a frozen `__init__` sets each field
through `object.__setattr__` (an `XAdd` 3.6 against 0.9 µs here) and the orchestrator
makes several per request. Nothing changes an op once it is queued (`replace` copies).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, cast

from redis.typing import EncodableT, FieldT

from omni_runtime import codec, keys

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


Op = XAdd | XAck | XDel | Expire | HashPut | HashDrop | ExpireAt


def fill_pipeline(pipe: Any, ops: list[Op]) -> None:
    """The XADDs in order, urgent ones last; then one XACK per stream with all its ids (and
    one XDEL of those to delete) and one EXPIRE per key, after the writes they follow (never
    an ack before its consequences).

    Urgent last, because Redis answers the readers a pipeline wakes last-woken first (its
    list of clients to write to is pushed at the head): of two readers blocked on streams
    one pipeline XADDs to, the second stream's reader had its entry ~150 µs sooner at p50
    here, in 9 pairs of 10; of three, the last stream's reader was answered first and the
    first's last (mean ranks 1.3 / 2.0 / 2.7). Urgent entries keep the order they were
    queued in, so the last queued is answered first: a streaming request's inputs are
    submitted downstream first, and stage 0's, whose first token the user waits for, is
    heard first. Only XADDs wake readers; the rest answer this process alone."""
    adds = merged([op for op in ops if isinstance(op, XAdd)])
    for add in sorted(adds, key=lambda a: a.urgent):  # stable: order kept otherwise
        if add.max_age_s is None:
            pipe.xadd(add.stream, xadd_fields(add.fields), maxlen=add.maxlen, approximate=True)
        else:
            minid = int((time.time() - add.max_age_s) * 1000)
            pipe.xadd(add.stream, xadd_fields(add.fields), minid=minid, approximate=False)
    for op in ops:  # states after the entries they record, before the acks they allow
        if isinstance(op, HashPut):
            pipe.hset(op.key, mapping=op.fields)
        elif isinstance(op, HashDrop):
            pipe.hdel(op.key, *op.fields)
        elif isinstance(op, ExpireAt):
            if op.at_ms is None:
                pipe.persist(op.key)
            else:
                pipe.pexpireat(op.key, op.at_ms)
    acks: dict[tuple[str, str], list[bytes]] = {}
    deletes: dict[str, list[bytes]] = {}
    expires: dict[str, int] = {}
    for op in ops:
        if isinstance(op, XAck):
            acks.setdefault((op.stream, op.group), []).append(op.entry_id)
            if op.delete:
                deletes.setdefault(op.stream, []).append(op.entry_id)
        elif isinstance(op, XDel):
            deletes.setdefault(op.stream, []).extend(op.entry_ids)
        elif isinstance(op, Expire):
            expires[op.key] = max(op.ttl_s, expires.get(op.key, 0))
    for (stream, group), ids in acks.items():
        pipe.xack(stream, group, *ids)
    for stream, ids in deletes.items():
        pipe.xdel(stream, *ids)
    for key, ttl_s in expires.items():
        pipe.expire(key, ttl_s)


def merged(adds: list[XAdd]) -> list[XAdd]:
    """`adds` with each stream's mergeable entries gathered into batch entries, in order,
    each at most `merge_up_to` payload bytes, where the stream's first one was: a client
    that gets the outputs of many requests costs one XADD per round trip, not one each.
    (A stream's entries are either all mergeable or none.)"""
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
    out: list[XAdd] = []
    for item in order:
        if isinstance(item, XAdd):
            out.append(item)
            continue
        group = mergeable[item]
        first = group[0]
        payloads = codec.pack_batches([add.fields[PAYLOAD] for add in group], first.merge_up_to)
        out.extend(replace(first, fields={PAYLOAD: p}, merge_up_to=0) for p in payloads)
    return out
