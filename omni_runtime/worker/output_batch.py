"""One round trip of the worker's outputs: where each goes, what is sent, the connection.

`OwnerRoutes` sends each request's outputs to the output stream of the orchestrator slot
that owns it (`StageInputMsg.owner`, recorded as its input is handed to the core); owners
of ended requests are kept a while, so an error output published after a request's final
still finds its way. An `OutputBatch` is one round trip's outputs, routed once, packed as
few entries per stream as fit (`pack_entries`), and the inputs they let go; a request's
entries past its first on a stream go in the round trips after (`first_wave`).
`HeldConnection` is the output thread's own connection, on which the worker's loop may
send a batch itself.

Handing a batch to the output thread costs a thread wake and a hand-over of the
interpreter lock before its first byte leaves, per stage of a request (measured in
docs/performance.md). When no write is in flight, the loop packs a small batch and sends
it on that connection itself (one `send` of a few KiB); the output thread reads the replies.
Batches the thread writes itself go out on the same connection, packed by hand: redis-py's
pipeline object costs more Python per call than the round trip (see `chunks/redis_packed`).

The loop never connects and never sends much: it sends only on a connection that is up
and only batches below `LOOP_SEND_MAX_BYTES`, so it cannot block on a connect or on a
full socket buffer. A failure drops the connection; the output thread writes the batch
again through its retry path and connects anew when it next writes.

Every reply is read, error replies included: Redis ran the rest of the batch around a
command it refused (out of memory refuses the XADDs, never the XACK and XDEL), so only
the refused commands are sent again (`OutputBatch.narrow`); an entry sent twice would
reach the orchestrator twice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.connection import Connection
from redis.exceptions import ResponseError

from omni_runtime import keys
from omni_runtime.redis_io import conn as rconn
from omni_runtime.redis_io.clients import is_cluster
from omni_runtime.redis_io.write_ops import xadd_fields
from omni_runtime.wire import codec
from omni_runtime.worker.actions import Input, Outgoing

LOOP_SEND_MAX_BYTES = 16 * 1024
"""Largest batch (payload bytes) the loop sends itself; bigger ones go to the thread. A
busy step engine's batches are big: packed on the thread, they overlap its next step
(which releases the interpreter lock while a model computes) instead of delaying it."""
ENDED_ROUTES = 10_000
"""Owners of ended requests remembered, for an error output published after the end."""

Command = tuple[Any, ...]


class OwnerRoutes:
    """Recorded by the loop as inputs arrive, read by whichever thread routes a batch."""

    def __init__(self, slot_stream: Callable[[int], str]) -> None:
        self.slot_stream = slot_stream
        self._owner: dict[str, int] = {}
        self._ended: OrderedDict[str, int] = OrderedDict()

    def record(self, inputs: Sequence[Input]) -> None:
        """Who owns each request, before any output of it is published."""
        for inp in inputs:
            self._owner[inp.msg.request_id] = inp.msg.owner

    def stream_of(self, out: Outgoing) -> str:
        rid = out.request_id
        slot = self._owner.pop(rid, None) if out.ends else self._owner.get(rid)
        if slot is None:
            slot = self._ended.get(rid, 0)
        elif out.ends:
            self._ended[rid] = slot
            if len(self._ended) > ENDED_ROUTES:
                self._ended.popitem(last=False)
        return self.slot_stream(slot)


@dataclass(slots=True)
class Entry:
    """One XADD: a stream, its payload (one output, or a batch), the outputs it carries."""

    stream: str
    payload: bytes
    outputs: list[Outgoing]


def pack_entries(stream: str, outputs: list[Outgoing], max_bytes: int) -> list[Entry]:
    """Outputs as few entries as fit in `max_bytes` each, a request's in one where they
    fit (`codec.batches`)."""
    groups = codec.batches(outputs, _payload_bytes, max_bytes, _request_of)
    return [_entry(stream, group) for group in groups]


def first_wave(entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """(this round trip's entries, the rest): a request's entries past its first on a
    stream wait for the next round trip, as in `write_ops.first_wave` (why)."""
    firsts: set[tuple[str, str]] = set()
    now: list[Entry] = []
    later: list[Entry] = []
    for e in entries:
        carried = {(e.stream, o.request_id) for o in e.outputs}
        (later if carried & firsts else now).append(e)
        firsts |= carried
    return now, later


def _payload_bytes(output: Outgoing) -> int:
    return len(output.payload)


def _request_of(output: Outgoing) -> str:
    return output.request_id


def _entry(stream: str, group: list[Outgoing]) -> Entry:
    payloads = [o.payload for o in group]
    return Entry(stream, payloads[0] if len(group) == 1 else codec.encode_batch(payloads), group)


@dataclass
class OutputBatch:
    """One round trip: entries per orchestrator slot stream, then the handled inputs
    acknowledged and deleted (so their memory comes back)."""

    outputs: list[Outgoing]
    entries: list[Entry]
    """Routed once, as routing forgets ended requests."""
    ack_ids: list[bytes]
    sent: int = 0
    """Commands the loop sent ahead, whose replies are still to read (0: not sent)."""
    commands: list[Command] = field(default_factory=list)
    acked: bool = False
    """The XACK and XDEL went through: a retry sends only the refused entries."""
    later: list[Entry] = field(default_factory=list)
    """Entries for the round trips after this one (`first_wave`); the XACK and XDEL go
    with the last."""
    checked: int = 0
    """The ownership checks applied when its outputs were taken (`OutputThread.forget`):
    one applied since means part of it may be another replica's now."""

    @classmethod
    def routed(
        cls, outputs: list[Outgoing], acks: list[bytes], routes: OwnerRoutes, max_bytes: int
    ) -> OutputBatch:
        """Each output to its owner's stream, as few entries per stream as fit `max_bytes`."""
        by_stream: dict[str, list[Outgoing]] = {}
        for out in outputs:
            by_stream.setdefault(routes.stream_of(out), []).append(out)
        entries = [
            entry
            for stream, outs in by_stream.items()
            for entry in pack_entries(stream, outs, max_bytes)
        ]
        ack_ids = [o.ack for o in outputs if o.ack is not None] + acks
        now, later = first_wave(entries)
        if later:
            return cls([o for e in now for o in e.outputs], now, ack_ids, later=later)
        return cls(outputs, entries, ack_ids)

    @property
    def unwritten(self) -> list[Outgoing]:
        """The outputs of this round trip and of those after it."""
        return [*self.outputs, *(o for e in self.later for o in e.outputs)]

    def next_wave(self) -> bool:
        """This round trip's entries are written: on to the next one's, if any is left."""
        if not self.later:
            return False
        self.entries, self.later = first_wave(self.later)
        self.outputs = [o for e in self.entries for o in e.outputs]
        self.commands = []
        return True

    def drop(self, claimed: set[str], lost_ack: Callable[[bytes], bool]) -> list[Outgoing]:
        """Leave out the outputs of `claimed` requests and the acknowledgements of inputs
        no longer this replica's (`lost_ack`); what was left out."""
        acks = [a for a in self.ack_ids if not lost_ack(a)]
        if len(acks) == len(self.ack_ids) and all(
            o.request_id not in claimed for o in self.unwritten
        ):
            return []
        dropped: list[Outgoing] = []

        def kept(entries: list[Entry]) -> list[Entry]:
            out = []
            for e in entries:
                mine = [o for o in e.outputs if o.request_id not in claimed]
                dropped.extend(o for o in e.outputs if o.request_id in claimed)
                if mine:
                    out.append(e if len(mine) == len(e.outputs) else _entry(e.stream, mine))
            return out

        self.entries, self.later, self.ack_ids, self.commands = (
            kept(self.entries), kept(self.later), acks, [])  # fmt: skip
        if not self.entries and self.later:
            self.entries, self.later = first_wave(self.later)
        self.outputs = [o for e in self.entries for o in e.outputs]
        return dropped

    @property
    def left(self) -> bool:
        """Anything still to write: an entry, or acknowledgements not yet through."""
        return bool(self.entries or self.later or (self.ack_ids and not self.acked))

    @property
    def payload_bytes(self) -> int:
        return sum(len(e.payload) for e in self.entries)

    def pack(self, in_stream: str, maxlen: int) -> list[Command]:
        """The commands, built once (a retry sends the same)."""
        if not self.commands:
            self.commands = [
                ("XADD", e.stream, "MAXLEN", "~", maxlen, "*", keys.PAYLOAD_FIELD, e.payload)
                for e in self.entries
            ]
            if self.ack_ids and not (self.acked or self.later):
                self.commands.append(("XACK", in_stream, keys.WORKERS_GROUP, *self.ack_ids))
                self.commands.append(("XDEL", in_stream, *self.ack_ids))
        return self.commands

    def narrow(self, replies: list[Any]) -> list[ResponseError]:
        """Keep only what Redis refused (replies in `pack` order, which `queue_entries`
        then `queue_acks` keep): the errors, none if all of it went through."""
        errors = [r for r in replies if isinstance(r, ResponseError)]
        if errors:
            n = len(self.entries)
            added = zip(self.entries, replies[:n], strict=True)
            self.entries = [e for e, r in added if isinstance(r, ResponseError)]
            if len(replies) > n:  # the XACK and XDEL were sent
                self.acked = self.acked or not any(
                    isinstance(r, ResponseError) for r in replies[n:]
                )
            self.outputs = [o for e in self.entries for o in e.outputs]
            self.commands = []
        return errors

    def per_request(self) -> None:
        """One entry per request instead of one per stream: Redis short of memory refuses
        a command bigger than the room it has left (its own bytes count), so smaller ones
        get through as memory comes back. Each request's outputs stay in one entry, in
        order (two could pass each other)."""
        split: list[Entry] = []
        for e in self.entries:
            mine: dict[str, list[Outgoing]] = {}
            for o in e.outputs:
                mine.setdefault(o.request_id, []).append(o)
            split.extend(_entry(e.stream, group) for group in mine.values())
        if len(split) != len(self.entries):
            self.entries, self.commands = split, []

    def queue_entries(self, pipe: Any, maxlen: int) -> bool:
        """The entries of `pack` on a redis-py pipeline (a cluster routes each command by
        key); whether there were any."""
        for e in self.entries:
            fields = xadd_fields({keys.PAYLOAD_FIELD: e.payload})
            pipe.xadd(e.stream, fields, maxlen=maxlen, approximate=True)
        return bool(self.entries)

    def queue_acks(self, pipe: Any, in_stream: str) -> bool:
        """The acknowledgement and deletion of `pack`, if due; whether they were."""
        if not self.ack_ids or self.acked or self.later:
            return False
        pipe.xack(in_stream, keys.WORKERS_GROUP, *self.ack_ids)
        pipe.xdel(in_stream, *self.ack_ids)
        return True


class HeldConnection:
    """One pooled connection held for the process's output: sends from either thread, one
    batch at a time (the output thread's `_writing` flag is the turn); replies read by the
    output thread only."""

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._conn: Connection | None = None
        self.up = False
        """Connected and not failed since: only then may the loop send."""

    @staticmethod
    def for_client(client: object) -> HeldConnection | None:
        """A plain client's; None for a cluster (its commands route per key) or a stand-in."""
        if isinstance(client, redis.Redis) and not is_cluster(client):
            return HeldConnection(client)
        return None

    def send(self, commands: list[Command]) -> None:
        """Pack and send; connects first if down (the output thread only). Raises RedisError."""
        if self._conn is None:
            self._conn = rconn.take(self._pool)
        conn = self._conn
        assert conn is not None
        with rconn.in_step(conn, self._drop):
            rconn.send(conn, commands, check=False)
        self.up = True

    def replies(self, count: int) -> list[Any]:
        """Read `count` replies (the output thread only), an error reply as its
        `ResponseError` (read whole: the connection is still in step)."""
        conn = self._conn
        if conn is None:
            raise redis.exceptions.ConnectionError("the held connection was dropped")
        with rconn.in_step(conn, self._drop):  # replies left unread: out of step
            return rconn.replies(conn, count)

    def close(self) -> None:
        if self._conn is not None:
            rconn.give_back(self._pool, self._conn)
            self._conn = None
        self.up = False

    def _drop(self) -> None:
        self.up = False
        if self._conn is not None:
            rconn.drop(self._conn)
