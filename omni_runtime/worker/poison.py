"""Which request broke a step engine's batch, found without the engine's help: pure bookkeeping.

A step engine that raises cannot say which of its requests made it fail (a real one,
llama.cpp or vLLM, does not know). The worker resets the engine and runs the failed step's
requests again; `Quarantine` decides who goes back in, who waits, and who is the poison.
It counts engine steps only (no clock, no I/O), so every rule is a unit test.

* **Blame.** A request runs its own steps, numbered from its (re-)admission; a failed step
  is step *i* of every request the engine held. A request at a step it has passed cleanly
  before (a re-run replaying, deterministic) cannot be the cause; of the others, the
  suspects are blamed if any are there, else all of them. A suspect is a request blamed
  before that has not since passed the step it was blamed at, or a newcomer before its
  first clean step (so a batch that fails when one request joins it blames that one).
* **Strikes.** Each blame is a strike. A request blamed alone with `strikes` strikes (K,
  `OMNI_WORKER_POISON_STRIKES`) is the poison: it ends; the others go on. `strike_limit`
  bounds the strikes of one never blamed alone, so that the failures always end.
* **Bisection.** A blamed group of n goes back in halves: the first at once, the second
  held back until a step after it passed cleanly (newcomers wait behind held suspects).
  One poison among n fresh requests costs 1 + ceil(log2 n) failed steps; a poison joining
  running requests, K (figures: docs/stages.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

POISON_STRIKES = 2
"""Strikes, blamed alone, that make a request the poison (`OMNI_WORKER_POISON_STRIKES`)."""
STRIKE_MARGIN = 24
"""Strikes beyond `POISON_STRIKES` after which a request ends even if never blamed alone: a
bisection blames its poison once per halving, ~17 times for 65,536 requests."""


@dataclass(slots=True)
class _Record:
    proven: int = 0
    """The most of its own steps it is known to pass cleanly, over all its runs."""
    frontier: int = 1
    """It stays a suspect until it has passed this many of its own steps (a newcomer: 1)."""
    strikes: int = 0


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a failed step decided. The engine was reset: `readmitted` go back in now, in
    this order; `held_back` wait; `poisoned` end (each with its strikes in `strikes`)."""

    blamed: tuple[str, ...]
    poisoned: tuple[str, ...]
    readmitted: tuple[str, ...]
    held_back: tuple[str, ...]
    strikes: dict[str, int]


class Quarantine:
    """Admission of a step engine's requests around its failed steps (see the module doc).

    The caller reports each request's arrival and end, and each step's outcome; it gives
    the engine exactly the requests these calls return, and holds the others back.
    """

    def __init__(self, strikes: int = POISON_STRIKES, strike_limit: int | None = None) -> None:
        if strikes < 1:
            raise ValueError(f"strikes must be at least 1, got {strikes}")
        self.strikes = strikes
        self.strike_limit = max(strikes, strike_limit or strikes + STRIKE_MARGIN)
        self._records: dict[str, _Record] = {}
        self._in_engine: dict[str, int] = {}
        """The requests the engine holds, in the order it got them: the step count then."""
        self._held: deque[list[str]] = deque()
        """Groups waiting, next first: blamed halves, then newcomers that came meanwhile."""
        self._newcomers: list[str] | None = None
        """The last group of `_held` when it is newcomers (who join it)."""
        self._steps = 0
        self.failed_steps = 0

    @property
    def in_engine(self) -> list[str]:
        return list(self._in_engine)

    @property
    def held_back(self) -> int:
        return sum(1 for group in self._held for rid in group if self._is_held(rid))

    def is_in_engine(self, request_id: str) -> bool:
        return request_id in self._in_engine

    def strikes_of(self, request_id: str) -> int:
        record = self._records.get(request_id)
        return 0 if record is None else record.strikes

    def arrive(self, request_id: str) -> bool:
        """A new request: True if it goes into the engine now, False if it waits."""
        self._records[request_id] = _Record()
        if not self._held:
            self._admit(request_id)
            return True
        if self._newcomers is None:
            self._newcomers = []
            self._held.append(self._newcomers)
        self._newcomers.append(request_id)
        return False

    def forget(self, request_id: str) -> None:
        """The request ended (finished, failed, aborted): it is no longer anyone's concern."""
        self._records.pop(request_id, None)
        self._in_engine.pop(request_id, None)

    def stepped(self) -> list[str]:
        """A step passed cleanly: the next held group, if any, to give the engine now."""
        self._steps += 1
        return self._next_group() if self._held else []

    def idle(self) -> list[str]:
        """The engine holds nothing (its requests ended): the next held group goes in."""
        return self._next_group() if self._held and not self._in_engine else []

    def failed(self) -> Verdict:
        """The step raised and the engine was reset: blame, strike, split (module doc)."""
        self._steps += 1
        self.failed_steps += 1
        engine = list(self._in_engine)
        index: dict[str, int] = {}
        fresh: list[str] = []
        suspects: list[str] = []
        for rid, admitted_at in self._in_engine.items():
            rec = self._records[rid]
            index[rid] = i = self._steps - admitted_at  # its own step that failed
            if i > rec.proven:  # not a step it passed before
                fresh.append(rid)
            rec.proven = max(rec.proven, i - 1)  # the steps before this one passed
            if rid in fresh and rec.frontier > rec.proven:
                suspects.append(rid)
        blamed = suspects or fresh or engine
        strikes: dict[str, int] = {}
        for rid in blamed:
            rec = self._records[rid]
            rec.strikes += 1
            rec.frontier = max(rec.frontier, index[rid])
            strikes[rid] = rec.strikes
        alone = len(blamed) == 1
        poisoned = [
            rid
            for rid in blamed
            if strikes[rid] >= self.strike_limit or (alone and strikes[rid] >= self.strikes)
        ]
        for rid in poisoned:
            self.forget(rid)
        rest = [rid for rid in blamed if rid not in poisoned]
        later = set(rest[(len(rest) + 1) // 2 :])
        readmitted = [rid for rid in engine if rid in self._records and rid not in later]
        held_back = [rid for rid in rest if rid in later]
        for rid in held_back:
            del self._in_engine[rid]
        if held_back:
            self._held.appendleft(held_back)
        for rid in readmitted:
            self._in_engine[rid] = self._steps
        return Verdict(tuple(blamed), tuple(poisoned), tuple(readmitted), tuple(held_back), strikes)

    def _admit(self, request_id: str) -> None:
        self._in_engine[request_id] = self._steps

    def _is_held(self, request_id: str) -> bool:
        return request_id in self._records and request_id not in self._in_engine

    def _next_group(self) -> list[str]:
        """Admit the first held group that still has a live request; its ids."""
        while self._held:
            group = self._held.popleft()
            if group is self._newcomers:
                self._newcomers = None
            live = [rid for rid in group if self._is_held(rid)]
            if live:
                for rid in live:
                    self._admit(rid)
                return live
        return []
