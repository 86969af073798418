"""Writes Redis refused for memory, held by the writer and written again once it has room.

Redis out of memory (`maxmemory` with `noeviction`) refuses every command that may
grow memory, whatever its size, until enough is freed: by requests ending and their
entries being deleted, by connection buffers draining, or by an operator raising
maxmemory. So a refused write is not sent again at once, nor in a loop that holds the
writer up: the batches after it still go out (acknowledgements and deletions among
them, which are what frees memory), and the held writes are tried again after a
short, growing delay (at most `PROBE_MAX_S`), by one of them alone, a probe. Once a
write that needs memory goes through, the rest follow at once.

Nothing is reordered. A later entry of the same request on the same stream (a client's
next output, say) is held behind the one refused, and of a request's held entries on one
stream only the oldest is tried at a time (in one round trip, a smaller one after it
could pass it); a state (a field of a hash) written later supersedes the held one, which
is never written over it. A write held longer than the writer's whole retry budget is
given up, with the request's other held writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.write_ops import (
    PAYLOAD,
    ExpireAt,
    HashDrop,
    HashPut,
    Op,
    XAdd,
    owners,
    payload_bytes,
)
from omni_runtime.wire import codec

PROBE_MAX_S = 0.25
"""The longest wait between two probes: memory freed is used within this."""


class HeldWrites:
    def __init__(self, initial_s: float, max_hold_s: float) -> None:
        self.max_hold_s = max_hold_s
        self._delay = Backoff(initial_s, PROBE_MAX_S)
        self._ops: list[Op] = []
        """Held, oldest first."""
        self._since: dict[int, float] = {}
        """id(op) → when it was first held."""
        self._due_at = 0.0
        self._probe = True
        """The next try sends the oldest held op alone (no room seen since the last refusal)."""

    def __len__(self) -> int:
        return len(self._ops)

    @property
    def due_at(self) -> float | None:
        """When the held ops are to be tried again (loop time); None: none held."""
        return self._due_at if self._ops else None

    def hold(self, refused: list[Op], now: float) -> list[Op]:
        """Hold ops Redis refused for memory, ahead of those still held (they were taken
        from the front, or are newer than any held: the writer sends one batch at a time).
        Returns those held too long, with the other held ops of their requests: given up."""
        self._ops[:0] = refused
        for op in refused:
            self._since.setdefault(id(op), now)
        self._probe = True
        self._due_at = now + (self._delay.failed() or 0.0)
        return self._expired(now)

    def room(self, now: float) -> None:
        """A write that needed memory went through: the held ones may all go, now."""
        self._delay.succeeded()
        self._probe = False
        self._due_at = now

    def forget(self, ops: Sequence[Op]) -> None:
        """Ops written (or given up) at last."""
        if self._since:
            for op in ops:
                self._since.pop(id(op), None)

    def take(self, ops: list[Op], now: float) -> list[Op]:
        """What of the held ops and the new `ops` goes out now, held ones first: once due,
        every held op (or the oldest alone, as a probe); of the new ones, those that need
        not follow a held one."""
        if not self._ops:
            return ops
        out: list[Op] = []
        if now >= self._due_at:
            self._ops = self._per_request(self._ops)
            n = 1 if self._probe else len(self._ops)
            due, self._ops = self._ops[:n], self._ops[n:]
            waiting: list[Op] = []
            for op in due:
                (waiting if self._behind_taken(op, out) else out).append(op)
            self._ops[:0] = waiting
            self._due_at = now + PROBE_MAX_S  # until the replies say otherwise
        for op in ops:
            if self._behind(op, out):
                self._ops.append(op)  # not a refusal of its own
            else:
                out.append(op)
        return out

    def drain(self) -> list[Op]:
        """Every op held (the writer stops: they are given up)."""
        ops, self._ops = self._ops, []
        self._since.clear()
        return ops

    @staticmethod
    def _behind_taken(op: Op, taken: list[Op]) -> bool:
        """A held entry of a request whose older entry on the stream is being tried."""
        return isinstance(op, XAdd) and op.owner is not None and _in_line(op, taken)

    def _behind(self, op: Op, taken: list[Op]) -> bool:
        """Whether `op` must follow a held op (or one `taken` to retry, in the same batch
        where it might pass the refused one); a newer state instead supersedes the held."""
        if isinstance(op, XAdd):
            return _in_line(op, [*self._ops, *taken])
        if isinstance(op, HashPut | HashDrop):
            for h in self._ops:  # a newer state of a field: the held one is obsolete
                if isinstance(h, HashPut) and h.key == op.key:
                    for f in op.fields:
                        h.fields.pop(f, None)
            emptied = [h for h in self._ops if isinstance(h, HashPut) and not h.fields]
            if emptied:
                self.forget(emptied)
                self._ops = [h for h in self._ops if not (isinstance(h, HashPut) and not h.fields)]
            return False
        if isinstance(op, ExpireAt):  # after the held state that creates its hash
            return any(isinstance(h, HashPut) and h.key == op.key for h in self._ops)
        return False

    def _per_request(self, ops: list[Op]) -> list[Op]:
        """Held entries that would share one (a client's outputs of many requests) as
        entries of one request each instead: Redis short of memory refuses a command
        bigger than the room it has left (its own bytes count), so smaller ones get through
        first. A request's outputs held through a long refusal fill as many entries as the
        stream's bound (`merge_up_to`) needs, in order (`take` tries one at a time)."""
        groups: dict[tuple[str, str | None], list[XAdd]] = {}
        out: list[Op | tuple[str, str | None]] = []
        for op in ops:
            if isinstance(op, XAdd) and op.merge_up_to:
                key = (op.stream, op.owner)
                if key not in groups:
                    groups[key] = []
                    out.append(key)
                groups[key].append(op)
            else:
                out.append(op)
        if not groups:
            return ops
        result: list[Op] = []
        for item in out:
            if not isinstance(item, tuple):
                result.append(item)
                continue
            group = groups[item]
            for parts in codec.batches(group, payload_bytes, group[0].merge_up_to):
                payloads = [p.fields[PAYLOAD] for p in parts]
                one = payloads[0] if len(parts) == 1 else codec.encode_batch(payloads)
                joined = replace(parts[0], fields={PAYLOAD: one}, merge_up_to=0)
                since = [self._since[id(p)] for p in parts if id(p) in self._since]
                if since:
                    self._since[id(joined)] = min(since)
                self.forget(parts)
                result.append(joined)
        return result

    def _expired(self, now: float) -> list[Op]:
        since = self._since
        old = [op for op in self._ops if now - since.get(id(op), now) >= self.max_hold_s]
        if not old:
            return []
        rids = {rid for op in old for rid in owners(op)}
        gone = {id(op) for op in old}
        gone |= {id(op) for op in self._ops if rids.intersection(owners(op))}
        out = [op for op in self._ops if id(op) in gone]
        self._ops = [op for op in self._ops if id(op) not in gone]
        self.forget(out)
        return out


def _in_line(add: XAdd, ops: Sequence[Op]) -> bool:
    """Whether an entry of the same request on the same stream is among `ops`."""
    return any(isinstance(h, XAdd) and h.stream == add.stream and h.owner == add.owner for h in ops)
