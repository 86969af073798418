"""The scheduler loop's turn: a delivering thread runs the pass itself only when no other
thread is in one; otherwise the loop is woken, and nothing is run twice at once."""

from __future__ import annotations

import threading

import pytest

from omni_runtime.worker.turn import LoopTurn


def make() -> tuple[LoopTurn, threading.Event, list[str]]:
    wake = threading.Event()
    ran: list[str] = []
    turn = LoopTurn(lambda: ran.append(threading.current_thread().name), wake)
    turn.shared = True
    return turn, wake, ran


def test_a_free_turn_runs_the_pass_on_the_delivering_thread() -> None:
    turn, wake, ran = make()
    t = threading.Thread(target=turn.deliver, name="input-reader")
    t.start()
    t.join(5)
    assert ran == ["input-reader"] and not wake.is_set()


def test_a_turn_in_use_wakes_the_loop_instead() -> None:
    turn, wake, ran = make()
    with turn.lock:  # the loop's own thread is in a pass
        turn.deliver()
    assert ran == [] and wake.is_set()


def test_a_step_engine_keeps_its_own_thread() -> None:
    turn, wake, ran = make()
    turn.shared = False
    turn.deliver()
    assert ran == [] and wake.is_set()


def test_a_failed_pass_is_kept_for_the_loop_and_no_pass_runs_after_it() -> None:
    wake = threading.Event()
    calls: list[int] = []

    def failing() -> None:
        calls.append(1)
        raise RuntimeError("bug in a pass")

    turn = LoopTurn(failing, wake)
    turn.shared = True
    turn.deliver()  # the delivering thread (an I/O thread) must not die of it
    assert isinstance(turn.failure, RuntimeError) and wake.is_set()
    turn.deliver()
    assert calls == [1]
    with pytest.raises(RuntimeError, match="bug in a pass"):  # what the loop does with it
        raise turn.failure


def test_after_close_only_the_wake_is_left() -> None:
    turn, wake, ran = make()
    turn.close()
    turn.deliver()
    assert ran == [] and wake.is_set()


def test_passes_never_overlap() -> None:
    """Many threads delivering at once: at most one pass at a time, and every delivery
    either ran a pass or woke the loop."""
    wake = threading.Event()
    inside = 0
    overlaps = 0
    lock = threading.Lock()
    passes = 0

    def one_pass() -> None:
        nonlocal inside, overlaps, passes
        with lock:
            inside += 1
            overlaps += inside > 1
            passes += 1
        for _ in range(200):  # long enough for others to arrive meanwhile
            pass
        with lock:
            inside -= 1

    turn = LoopTurn(one_pass, wake)
    turn.shared = True
    start = threading.Barrier(8)

    def deliver_many() -> None:
        start.wait()
        for _ in range(200):
            turn.deliver()

    threads = [threading.Thread(target=deliver_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert overlaps == 0 and passes > 0
    assert passes == 8 * 200 or wake.is_set()
