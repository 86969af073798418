"""The watchdog's decision on a given clock, and its thread's last act (`omni_runtime/watchdog.py`)."""

from __future__ import annotations

import logging
import threading

import pytest

from omni_runtime.watchdog import (
    WEDGED_EXIT_CODE,
    Progress,
    Stuck,
    Watchdog,
    redis_retries_s,
    thread_stack,
)
from tests.waiting import wait_until

LIMIT_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat_at(p: Progress, at: float) -> None:
    """`Progress.beat`, at a time of the test's clock."""
    p.at = at
    p.rounds += 1


def watchdog(clock: Clock, *loops: Progress) -> Watchdog:
    dog = Watchdog(LIMIT_S, clock=clock)
    for p in loops:
        dog.watch(p)
        beat_at(p, clock.now)
    return dog


def names(stuck: list[Stuck]) -> list[str]:
    return [s.name for s in stuck]


def test_a_loop_with_work_in_hand_that_stops_going_around_is_stuck_past_the_limit() -> None:
    clock = Clock()
    wedged, busy = Progress("wedged"), Progress("busy")
    dog = watchdog(clock, wedged, busy)
    for _ in range(10):  # every second the busy loop goes around; the wedged one never
        clock.now += 1.0
        beat_at(busy, clock.now)
        assert dog.check() == []
    clock.now += 0.5
    beat_at(busy, clock.now)
    stuck = dog.check()
    assert names(stuck) == ["wedged"]
    assert stuck[0].idle_s == pytest.approx(10.5)


def test_a_loop_with_nothing_in_hand_is_never_stuck() -> None:
    clock = Clock()
    idle = Progress("idle", lambda: False)
    dog = watchdog(clock, idle)
    clock.now += 100 * LIMIT_S
    assert dog.check() == []


def test_work_that_just_came_in_is_not_taken_for_old_work() -> None:
    """A loop idle (not pending) for long, then pending: it gets the whole limit from the
    check that last saw it idle, not from its last beat long ago."""
    clock = Clock()
    pending = False
    loop = Progress("loop", lambda: pending)
    dog = watchdog(clock, loop)
    clock.now += 5 * LIMIT_S
    assert dog.check() == []  # idle: the check remembers when it looked
    clock.now += 1.0
    pending = True
    assert dog.check() == []
    clock.now += LIMIT_S - 1.5
    assert dog.check() == []
    clock.now += 1.0  # LIMIT_S + 0.5 after the check that saw it idle
    assert names(dog.check()) == ["loop"]


def test_going_around_once_restarts_the_count() -> None:
    clock = Clock()
    loop = Progress("loop")
    dog = watchdog(clock, loop)
    clock.now += LIMIT_S - 1
    assert dog.check() == []
    beat_at(loop, clock.now)
    clock.now += LIMIT_S - 1
    assert dog.check() == []
    clock.now += 2
    assert names(dog.check()) == ["loop"]


def test_a_loop_is_given_its_slack_on_top_of_the_limit() -> None:
    clock = Clock()
    io_thread = Progress("io", slack_s=30.0)
    dog = watchdog(clock, io_thread)
    clock.now += LIMIT_S + 29
    assert dog.check() == []
    clock.now += 2
    assert names(dog.check()) == ["io"]


def test_a_forgotten_loop_is_not_watched() -> None:
    clock = Clock()
    gone = Progress("gone")
    dog = watchdog(clock, gone)
    dog.forget(gone)
    clock.now += 2 * LIMIT_S
    assert dog.check() == []


def test_where_a_loop_is_comes_from_its_own_description_or_its_threads_stack() -> None:
    clock = Clock()
    described = Progress("described", where=lambda: "in the slot loop")

    def broken_description() -> str:
        raise ZeroDivisionError("a diagnostic that fails never stops the watchdog")

    broken = Progress("broken", where=broken_description)
    dog = watchdog(clock, described, broken)
    clock.now += 2 * LIMIT_S
    where = {s.name: s.where for s in dog.check()}
    assert where["described"] == "in the slot loop"
    assert "ZeroDivisionError" in where["broken"]


def test_a_threads_stack_shows_where_it_waits() -> None:
    waiting, release = threading.Event(), threading.Event()

    def blocked_in_a_wait() -> None:
        waiting.set()
        release.wait()

    thread = threading.Thread(target=blocked_in_a_wait)
    thread.start()
    try:
        waiting.wait(10)
        assert thread.ident is not None
        stack = thread_stack(thread.ident)
        assert "blocked_in_a_wait" in stack and "release.wait()" in stack
    finally:
        release.set()
        thread.join()
    assert thread_stack(thread.ident) == "(its thread is gone)"


def test_the_watchdog_logs_gives_back_and_exits(caplog: pytest.LogCaptureFixture) -> None:
    """The thread checks on its own; once a loop is wedged it logs where, runs `on_stuck`
    (even one that fails) and exits with the wedged code."""
    exited: list[int] = []
    given_back: list[list[str]] = []

    def on_stuck(stuck: list[Stuck]) -> None:
        given_back.append(names(stuck))
        raise RuntimeError("Redis is gone too")

    dog = Watchdog(0.05, on_stuck, exit=exited.append)
    wedged = dog.watch(Progress("wedged loop", where=lambda: "frame of the wedged loop"))
    with caplog.at_level(logging.CRITICAL, logger="omni_runtime.watchdog"):
        dog.start()
        wait_until(lambda: exited != [], 10)
    assert exited == [WEDGED_EXIT_CODE]
    assert given_back == [["wedged loop"]]
    assert wedged.rounds == 0
    assert "wedged loop made no progress" in caplog.text
    assert "frame of the wedged loop" in caplog.text


def test_a_stopped_watchdog_never_fires() -> None:
    exited: list[int] = []
    dog = Watchdog(0.05, exit=exited.append)
    dog.watch(Progress("left with work in hand at a shutdown"))
    dog.stop()
    dog.start()
    assert dog._thread is not None
    dog._thread.join(10)
    assert not dog._thread.is_alive() and exited == []


def test_a_redis_retry_bounds_the_slack_of_a_loop_that_waits_on_redis() -> None:
    assert redis_retries_s(20, 2.0) == pytest.approx(140.0)
