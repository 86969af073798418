"""`StagePool`: every call runs once and is reported done; threads up to the bound only."""

from __future__ import annotations

import functools
import threading

import pytest

from omni_runtime.worker.stage_pool import StagePool
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.n += 1


def test_every_call_runs_and_is_reported_done() -> None:
    done, ran = Counter(), list[int]()
    pool = StagePool(4, "t-pool", done)
    for i in range(50):
        pool.submit(ran.append, i)
    wait_until(lambda: done.n == 50)
    assert sorted(ran) == list(range(50))
    pool.shutdown()
    pool.join(5)


def test_no_more_threads_than_the_bound_and_the_rest_wait_their_turn() -> None:
    done, gate, started = Counter(), threading.Event(), Counter()

    def blocked() -> None:
        started()
        gate.wait(10)

    pool = StagePool(2, "t-bound", done)
    for _ in range(5):
        pool.submit(blocked)
    wait_until(lambda: started.n == 2)
    assert len([t for t in threading.enumerate() if t.name.startswith("t-bound_")]) == 2
    assert done.n == 0
    gate.set()
    wait_until(lambda: done.n == 5)
    assert started.n == 5
    pool.shutdown()
    pool.join(5)


def test_an_idle_thread_takes_the_next_call_instead_of_a_new_one() -> None:
    done = Counter()
    pool = StagePool(8, "t-idle", done)
    for i in range(20):
        pool.submit(lambda: None)
        wait_until(functools.partial(lambda n: done.n == n, i + 1))  # one at a time
    assert len([t for t in threading.enumerate() if t.name.startswith("t-idle_")]) == 1
    pool.shutdown()
    pool.join(5)


def test_shutdown_drops_calls_not_started_reports_them_done_and_threads_exit() -> None:
    done, gate, ran = Counter(), threading.Event(), list[int]()
    pool = StagePool(1, "t-shut", done)
    pool.submit(gate.wait, 10)
    for i in range(3):
        pool.submit(ran.append, i)
    wait_until(lambda: any(t.name == "t-shut_0" for t in threading.enumerate()))
    pool.shutdown()
    assert done.n == 3  # the three queued ones, dropped
    gate.set()
    pool.join(5)
    assert ran == [] and done.n == 4
    assert not [t for t in threading.enumerate() if t.name.startswith("t-shut_")]
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(ran.append, 9)


def test_a_call_raising_past_its_handler_is_logged_and_the_thread_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    done, ran = Counter(), list[int]()

    def boom() -> None:
        raise SystemExit("stage code called exit")

    pool = StagePool(1, "t-raise", done)
    pool.submit(boom)
    pool.submit(ran.append, 1)
    wait_until(lambda: done.n == 2)
    assert ran == [1]
    assert "raised past its handler" in caplog.text
    pool.shutdown()
    pool.join(5)
