"""The async engine driver: an `AsyncStageEngine` driven as the worker drives step engines."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_runtime.errors import StartupTimeoutError
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.start import Observability, ObserveSettings
from omni_runtime.pipeline import StageConfig
from omni_runtime.settings import Settings
from omni_runtime.stage_api import (
    ChunkStream,
    EngineDead,
    EngineOutput,
    EngineStats,
    Final,
    StageEngine,
    marks_final,
)
from omni_runtime.worker.async_engine import AsyncEngineDriver
from omni_runtime.worker.engines import load_engine
from omni_runtime.worker.observed import WorkerObservation
from tests.engines.tiny_async import TinyAsyncEngine
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


class Collector:
    """Steps the driver whenever it has work, as the worker's loop does."""

    def __init__(self, driver: AsyncEngineDriver) -> None:
        self.driver = driver
        self.outputs: list[EngineOutput] = []

    def of(self, rid: str) -> list[tuple[Any, bool, str | None]]:
        return [(o.data, o.finished, o.error) for o in self.outputs if o.request_id == rid]

    def until_ended(self, *rids: str, deadline_s: float = 10.0) -> None:
        def ended() -> bool:
            self.outputs.extend(self.driver.step())
            return all(any(f or e for _d, f, e in self.of(rid)) for rid in rids)

        wait_until(ended, deadline_s)


@pytest.fixture
def tiny() -> TinyAsyncEngine:
    return TinyAsyncEngine(capacity=2, token_delay_ms=1)


@pytest.fixture
def driven(tiny: TinyAsyncEngine) -> Iterator[tuple[AsyncEngineDriver, Collector]]:
    driver = AsyncEngineDriver(tiny, "tiny", wake=lambda: None, health_interval_s=0.05)
    driver.start()
    yield driver, Collector(driver)
    driver.close()


def test_the_constructor_starts_no_thread(tiny: TinyAsyncEngine) -> None:
    before = threading.active_count()
    driver = AsyncEngineDriver(tiny, "tiny", wake=lambda: None)
    assert threading.active_count() == before and not tiny.started
    driver.start()
    assert tiny.started and threading.active_count() == before + 1
    driver.close()
    wait_until(lambda: threading.active_count() == before)


def test_a_request_streams_its_items_and_the_last_is_finished(driven: Any) -> None:
    driver, seen = driven
    driver.add_request("r", "one two three")
    seen.until_ended("r")
    assert seen.of("r") == [("ONE", False, None), ("TWO", False, None), ("THREE", True, None)]


class ThreeThenEnd:
    """Yields `a`, `b`, then ends; marked or not (`marks_final`)."""

    def __init__(self, release: asyncio.Event | None = None) -> None:
        self.release = release

    async def start(self) -> None:
        pass

    async def generate(
        self, request_id: str, data: Any, params: dict[str, Any] | None
    ) -> AsyncIterator[Any]:
        yield "a"
        yield "b"
        yield Final("c")
        yield "never"

    async def abort(self, request_id: str) -> None:
        pass

    async def check_health(self) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 1)

    async def close(self) -> None:
        pass


def test_final_ends_the_request_at_once_and_nothing_after_it_goes_out() -> None:
    driver = AsyncEngineDriver(ThreeThenEnd(), "three", wake=lambda: None)
    driver.start()
    seen = Collector(driver)
    driver.add_request("r", None)
    seen.until_ended("r")
    assert seen.of("r") == [("a", False, None), ("b", False, None), ("c", True, None)]
    driver.close()


class Gated(ThreeThenEnd):
    """`@marks_final`: its first chunk goes out before the second is made."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    @marks_final
    async def generate(
        self, request_id: str, data: Any, params: dict[str, Any] | None
    ) -> AsyncIterator[Any]:
        yield "first"
        while not self.go.is_set():
            await asyncio.sleep(0.001)
        yield Final("last")


def test_a_marks_final_generate_sends_each_item_without_holding_one_back() -> None:
    engine = Gated()
    driver = AsyncEngineDriver(engine, "gated", wake=lambda: None)
    driver.start()
    seen = Collector(driver)
    driver.add_request("r", None)

    def first() -> bool:
        seen.outputs.extend(driver.step())
        return bool(seen.outputs)

    wait_until(first)
    assert seen.of("r") == [("first", False, None)]
    engine.go.set()
    seen.until_ended("r")
    assert seen.of("r")[-1] == ("last", True, None)
    driver.close()


def test_wake_is_called_per_chunk_and_ended_for_the_last(tiny: TinyAsyncEngine) -> None:
    calls: list[str] = []
    driver = AsyncEngineDriver(
        tiny, "tiny", wake=lambda: calls.append("wake"), ended=lambda: calls.append("ended")
    )
    driver.start()
    driver.add_request("r", "a b c")
    Collector(driver).until_ended("r")
    assert calls == ["wake", "wake", "ended"]
    driver.close()


def test_an_exception_from_generate_fails_that_request_alone(driven: Any) -> None:
    driver, seen = driven
    driver.add_request("bad", "x boom y")
    driver.add_request("good", "fine words")
    seen.until_ended("bad", "good")
    assert seen.of("bad") == [(None, True, "tiny generate() raised ValueError: cannot say 'BOOM'")]
    assert seen.of("good") == [("FINE", False, None), ("WORDS", True, None)]
    assert driver.dead is None


def test_params_reach_generate(driven: Any) -> None:
    driver, seen = driven
    driver.add_request("r", "la", params={"max_tokens": 3})
    seen.until_ended("r")
    assert [d for d, _f, _e in seen.of("r")] == ["LA", "LA", "LA"]


def test_abort_stops_the_request_and_frees_its_slot(driven: Any, tiny: TinyAsyncEngine) -> None:
    driver, seen = driven
    driver.add_request("long1", "go", params={"max_tokens": 1_000_000})
    driver.add_request("long2", "go", params={"max_tokens": 1_000_000})
    driver.add_request("next", "now")
    wait_until(lambda: driver.stats() == EngineStats(running=2, waiting=1, capacity=2))
    driver.abort("long1")
    seen.until_ended("next")
    assert seen.of("next") == [("NOW", True, None)]
    assert "long1" in tiny.abort_calls
    seen.outputs.clear()
    wait_until(lambda: driver.stats().running == 1)
    seen.outputs.extend(driver.step())
    assert not seen.of("long1"), "no output of an aborted request"
    driver.abort("long2")
    wait_until(lambda: driver.stats() == EngineStats(running=0, waiting=0, capacity=2))
    driver.abort("never-seen")  # an unknown id: nothing happens


def test_a_streamed_input_is_read_without_blocking_the_loop(driven: Any) -> None:
    driver, seen = driven
    stream = ChunkStream()
    driver.add_request("s", stream)
    driver.add_request("other", "meanwhile")
    seen.until_ended("other")  # the loop runs while "s" waits for its input
    stream.extend(["a"], closed=False)
    stream.extend([["b", "c"]], closed=True)
    seen.until_ended("s")
    assert seen.of("s") == [("A", False, None), ("B", False, None), ("C", True, None)]


def test_an_aborted_stream_ends_its_request_quietly(driven: Any, tiny: TinyAsyncEngine) -> None:
    driver, seen = driven
    stream = ChunkStream(["x"])
    driver.add_request("s", stream)
    driver.abort("s")
    stream.abort()
    driver.add_request("after", "ok")
    seen.until_ended("after")
    assert not seen.of("s")


def test_a_failed_health_check_calls_on_dead_and_drops_every_output(tmp_path: Path) -> None:
    sick = tmp_path / "sick"
    engine = TinyAsyncEngine(capacity=1, token_delay_ms=1, sick_file=str(sick))
    reasons: list[str] = []
    driver = AsyncEngineDriver(
        engine, "tiny", wake=lambda: None, on_dead=reasons.append, health_interval_s=0.02
    )
    driver.start()
    driver.add_request("r", "go", params={"max_tokens": 1_000_000})
    wait_until(lambda: engine.running == 1)
    sick.touch()
    wait_until(lambda: bool(reasons))
    assert "check_health() raised EngineDead: turned unhealthy" in reasons[0]
    assert "OMNI_ENGINE_HEALTH_INTERVAL_S" in reasons[0]
    assert driver.dead == reasons[0]
    wait_until(lambda: engine.running == 0)
    assert driver.step() == []  # the request is left for another replica to take over
    driver.add_request("later", "x")
    assert driver.step() == [] and len(reasons) == 1
    driver.close()


class HangingHealth(ThreeThenEnd):
    async def check_health(self) -> None:
        await asyncio.sleep(3600)


def test_a_health_check_that_does_not_return_in_time_is_a_failure() -> None:
    reasons: list[str] = []
    driver = AsyncEngineDriver(
        HangingHealth(), "hang", wake=lambda: None, on_dead=reasons.append, health_interval_s=0.05
    )
    driver.start()
    wait_until(lambda: bool(reasons))
    assert "check_health() did not return within 0.05s" in reasons[0]
    driver.close()


def test_without_on_dead_a_dead_engine_fails_its_requests_fast() -> None:
    engine = TinyAsyncEngine(capacity=1, token_delay_ms=1)
    driver = AsyncEngineDriver(engine, "tiny", wake=lambda: None, health_interval_s=0.02)
    driver.start()
    seen = Collector(driver)
    driver.add_request("a", "go", params={"max_tokens": 1_000_000})
    driver.add_request("b", "waits")
    wait_until(lambda: engine.running == 1)
    engine.dead = "out of memory"
    seen.until_ended("a", "b")
    driver.add_request("c", "late")
    seen.until_ended("c")
    for rid in "abc":
        (*_, last) = seen.of(rid)
        assert last[1] and last[2] is not None and "out of memory" in last[2], (rid, last)
    driver.close()


def test_engine_dead_from_generate_takes_the_engine_out_of_service() -> None:
    engine = TinyAsyncEngine(capacity=2, token_delay_ms=1)
    reasons: list[str] = []
    driver = AsyncEngineDriver(
        engine, "tiny", wake=lambda: None, on_dead=reasons.append, health_interval_s=60
    )
    driver.start()
    driver.add_request("r", "go", params={"max_tokens": 1_000_000})
    wait_until(lambda: engine.running == 1)
    engine.dead = "CUDA error"
    wait_until(lambda: bool(reasons))
    assert reasons == ["generate('r') raised EngineDead: CUDA error"]
    driver.close()


def test_a_start_past_its_deadline_names_the_setting() -> None:
    engine = TinyAsyncEngine(start_delay_ms=10_000)
    driver = AsyncEngineDriver(engine, "slow", wake=lambda: None, start_timeout_s=0.1)
    with pytest.raises(StartupTimeoutError, match="OMNI_ENGINE_START_TIMEOUT_S"):
        driver.start()
    driver.close()


def test_close_is_idempotent_and_closes_the_engine_once(tiny: TinyAsyncEngine) -> None:
    driver = AsyncEngineDriver(tiny, "tiny", wake=lambda: None)
    driver.close()  # never started: nothing to do
    driver = AsyncEngineDriver(tiny, "tiny", wake=lambda: None)
    driver.start()
    driver.add_request("r", "go", params={"max_tokens": 1_000_000})
    wait_until(lambda: tiny.running == 1)
    driver.close()
    driver.close()
    assert tiny.closed == 1 and tiny.running == 0


def test_load_engine_wraps_an_async_engine_class() -> None:
    stage = StageConfig(
        id=1, name="tiny", entry="tests.engines.tiny_async:TinyAsyncEngine", options={"capacity": 3}
    )
    engine = load_engine(stage, None, max_concurrency=1, wake=lambda: None)
    assert isinstance(engine, AsyncEngineDriver) and isinstance(engine, StageEngine)
    engine.start()
    assert engine.stats() == EngineStats(running=0, waiting=0, capacity=3)
    engine.close()


def test_engine_dead_is_an_omni_error() -> None:
    from omni_runtime.errors import OmniError

    assert issubclass(EngineDead, OmniError)


def test_engine_stats_show_in_the_heartbeat_and_the_gauges() -> None:
    metrics = Metrics()
    observed = WorkerObservation(
        Observability(metrics), 3, "w1", "ns:stage:3:in", Settings().part(ObserveSettings)
    )
    assert "engine" not in observed.status(0)  # a function stage counts nothing of its own
    stats = [EngineStats(running=2, waiting=1, capacity=4)]
    observed.watch_engine(lambda: stats[0])
    assert observed.status(3)["engine"] == {"running": 2, "waiting": 1, "capacity": 4}
    gauges = {f: metrics.gauge(f"omni_engine_{f}", stage=3) for f in ("running", "waiting")}
    assert gauges == {"running": 2, "waiting": 1}
    assert metrics.gauge("omni_engine_capacity", stage=3) == 4
    stats[0] = EngineStats(running=0, waiting=0, capacity=4)
    assert metrics.gauge("omni_engine_running", stage=3) == 0  # read when scraped
