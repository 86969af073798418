"""Quarantine: who a failed step blames, who goes back in, who is the poison; no engine, no I/O.

`simulate` plays a continuous-batching engine (every step, every request it holds takes
its next step) whose step raises while a poison is at or past its trigger step; a reset
starts every request over. It counts the failed steps a scenario costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from omni_runtime.worker.poison import Quarantine

pytestmark = pytest.mark.timeout(30)


@dataclass
class Outcome:
    failed_steps: int = 0
    steps: int = 0
    poisoned: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


def simulate(
    q: Quarantine,
    length: dict[str, int],
    poisons: dict[str, int],
    arrivals: dict[int, list[str]] | None = None,
    fail_at: set[int] | None = None,
    max_steps: int = 10_000,
) -> Outcome:
    """Run until every request ended. `length`: each request's steps; `poisons`: the own
    step from which a request makes the step raise; `arrivals`: requests arriving before
    step k (the rest before step 1); `fail_at`: steps that raise whatever the batch."""
    arrivals = arrivals or {}
    late = {rid for group in arrivals.values() for rid in group}
    own: dict[str, int] = {}
    out = Outcome()

    def admit(rids: list[str] | tuple[str, ...]) -> None:
        for rid in rids:
            own[rid] = 0  # a reset engine starts it over

    for rid in length:
        if rid not in late and q.arrive(rid):
            admit([rid])
    while out.steps < max_steps:
        for rid in arrivals.get(out.steps + 1, []):
            if q.arrive(rid):
                admit([rid])
        admit(q.idle())
        batch = q.in_engine
        if not batch and (not arrivals or out.steps >= max(arrivals)):
            return out
        out.steps += 1
        for rid in batch:
            own[rid] += 1
        raises = out.steps in (fail_at or set())
        if raises or any(own[r] >= poisons[r] for r in batch if r in poisons):
            out.failed_steps += 1
            verdict = q.failed()
            out.poisoned += verdict.poisoned
            admit(verdict.readmitted)
            continue
        admit(q.stepped())
        for rid in batch:
            if own[rid] >= length[rid]:
                q.forget(rid)
                out.finished.append(rid)
    raise AssertionError(f"no end after {max_steps} steps: {out}")


def names(n: int, prefix: str = "r") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


@pytest.mark.parametrize("n", [2, 8, 64, 100])
def test_one_poison_among_n_fresh_requests_costs_about_log2_n_failed_steps(n: int) -> None:
    """Wherever the poison is in the batch: 1 + ceil(log2 n) failed steps, under the
    bound 2·log2(n) + K, and it alone fails."""
    bound = 2 * math.log2(n) + 2
    costs = []
    for position in range(n):
        rids = names(n)
        q = Quarantine(strikes=2)
        out = simulate(q, dict.fromkeys(rids, 6), {rids[position]: 1})
        assert out.poisoned == [rids[position]]
        assert sorted(out.finished) == sorted(r for r in rids if r != rids[position])
        costs.append(out.failed_steps)
    assert max(costs) <= bound
    assert max(costs) == 1 + math.ceil(math.log2(n)), costs


@pytest.mark.parametrize("strikes", [1, 2, 3])
def test_a_request_alone_that_makes_every_step_fail_ends_after_k_failed_steps(
    strikes: int,
) -> None:
    q = Quarantine(strikes=strikes)
    out = simulate(q, {"p": 5}, {"p": 1})
    assert out.poisoned == ["p"] and out.failed_steps == strikes


def test_a_poison_joining_running_requests_is_blamed_alone_and_costs_k_failed_steps() -> None:
    """The batch stepped cleanly until it came: requests at steps they passed before are
    not blamed, a newcomer is a suspect until its first clean step."""
    rids = names(20)
    q = Quarantine(strikes=2)
    out = simulate(q, {**dict.fromkeys(rids, 30), "p": 30}, {"p": 1}, arrivals={5: ["p"]})
    assert out.poisoned == ["p"] and out.failed_steps == 2
    assert sorted(out.finished) == sorted(rids)
    assert all(q.strikes_of(r) == 0 for r in rids)  # (forgotten: 0) none was blamed


def test_a_poison_that_fails_later_in_its_run_is_found_too() -> None:
    """It passes its first steps cleanly: blame falls on whoever is at a step it never
    passed, and the re-runs replaying theirs are not blamed."""
    rids = names(16)
    q = Quarantine(strikes=2)
    out = simulate(q, dict.fromkeys(rids, 12), {rids[11]: 5})
    assert out.poisoned == [rids[11]]
    assert sorted(out.finished) == sorted(r for r in rids if r != rids[11])
    assert out.failed_steps <= 2 * math.log2(16) + 2


def test_two_poisons_among_64_both_end_and_no_one_else() -> None:
    rids = names(64)
    q = Quarantine(strikes=2)
    out = simulate(q, dict.fromkeys(rids, 6), {rids[3]: 1, rids[40]: 1})
    assert sorted(out.poisoned) == sorted([rids[3], rids[40]])
    assert len(out.finished) == 62
    assert out.failed_steps <= 2 * (2 * math.log2(64) + 2)


def test_a_step_that_fails_once_for_no_request_ends_no_request() -> None:
    """A transient failure: everyone is blamed once, then steps cleanly and is cleared."""
    rids = names(32)
    q = Quarantine(strikes=2)
    out = simulate(q, dict.fromkeys(rids, 8), {}, fail_at={3})
    assert out.poisoned == [] and sorted(out.finished) == sorted(rids)
    assert out.failed_steps == 1


def test_an_engine_that_always_fails_ends_every_request_in_bounded_failed_steps() -> None:
    rids = names(40)
    q = Quarantine(strikes=2)
    out = simulate(q, dict.fromkeys(rids, 4), {r: 1 for r in rids})
    assert sorted(out.poisoned) == sorted(rids) and out.finished == []
    assert out.failed_steps <= 3 * len(rids)


def test_a_failed_batch_goes_back_in_halves_and_the_second_waits_for_a_clean_step() -> None:
    q = Quarantine(strikes=2)
    for rid in names(8):
        assert q.arrive(rid)
    verdict = q.failed()
    assert verdict.blamed == tuple(names(8)) and verdict.poisoned == ()
    assert verdict.readmitted == tuple(names(4)) and verdict.held_back == tuple(names(8)[4:])
    assert q.in_engine == names(4) and q.held_back == 4
    assert not q.arrive("new")  # a newcomer waits behind the held suspects
    assert q.stepped() == names(8)[4:]
    assert q.stepped() == ["new"]
    assert q.stepped() == [] and q.held_back == 0


def test_held_requests_go_in_once_the_engine_holds_none() -> None:
    """Its requests ended without another step (aborted, say): nothing is left to wait for."""
    q = Quarantine(strikes=2)
    for rid in ("a", "b"):
        q.arrive(rid)
    verdict = q.failed()
    assert verdict.readmitted == ("a",) and verdict.held_back == ("b",)
    assert q.idle() == []
    q.forget("a")
    assert q.idle() == ["b"] and q.in_engine == ["b"]


def test_a_held_request_that_ends_is_never_admitted() -> None:
    q = Quarantine(strikes=2)
    for rid in ("a", "b", "c", "d"):
        q.arrive(rid)
    q.failed()  # a, b in; c, d held
    q.forget("c")
    assert q.stepped() == ["d"]


def test_strikes_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Quarantine(strikes=0)
