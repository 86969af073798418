"""Request and stage durations observed from the events the runtime already sees."""

from __future__ import annotations

import time

import numpy as np
import pytest

from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.timings import RequestTimer, StageTimer, entry_age_s


def test_request_timer_observes_ttft_ttfa_and_e2e() -> None:
    m = Metrics()
    timer = RequestTimer(m)
    m.gauge_callback("omni_requests_running", timer.running_count)
    timer.started("r", t=10.0)
    assert m.gauge("omni_requests_running") == 1
    audio = np.zeros(160, dtype=np.float32)
    timer.output("r", "tok", False, None, t=10.1)
    timer.output("r", "tok", False, None, t=10.2)  # only the first token counts
    timer.output("r", audio, False, None, t=10.5)
    timer.output("r", audio, False, None, t=10.75)
    timer.output("r", audio, True, None, t=11.0)
    assert m.histogram("omni_time_to_first_token_seconds").sum == pytest.approx(0.1)
    assert m.histogram("omni_time_to_first_audio_seconds").sum == pytest.approx(0.5)
    assert m.histogram("omni_audio_gap_seconds").count == 0  # the client's measure, not this
    assert m.histogram("omni_e2e_request_latency_seconds").sum == pytest.approx(1.0)
    assert m.value("omni_requests_received_total") == 1
    assert m.gauge("omni_requests_running") == 0
    timer.output("r", "late", True, None)  # after the end: ignored
    assert m.histogram("omni_e2e_request_latency_seconds").count == 1


def test_request_timer_error_ends_and_bound_holds() -> None:
    m = Metrics()
    timer = RequestTimer(m, max_open=2)
    timer.started("a", t=0.0)
    timer.output("a", None, True, "deadline exceeded", t=3.0)
    assert m.histogram("omni_e2e_request_latency_seconds").sum == pytest.approx(3.0)
    assert m.histogram("omni_time_to_first_token_seconds").count == 0
    for rid in "bcd":
        timer.started(rid)
    assert timer.running_count() == 2


def test_stage_timer_queue_run_in_flight_outputs_errors() -> None:
    m = Metrics()
    timer = StageTimer(m, 1)
    written_ms = int(time.time() * 1000) - 250
    timer.read("r", f"{written_ms}-0".encode())
    assert m.gauge("omni_stage_inputs_in_flight", stage=1) == 1
    queue = m.histogram("omni_stage_queue_time_seconds", stage=1)
    assert queue.count == 1 and 0.2 < queue.sum < 30
    timer.output()
    timer.output(error="boom")
    timer.done("r")
    timer.done("r")
    assert m.gauge("omni_stage_inputs_in_flight", stage=1) == 0
    assert m.histogram("omni_stage_run_time_seconds", stage=1).count == 1
    assert m.value("omni_stage_outputs_total", stage=1) == 2
    assert m.value("omni_stage_errors_total", stage=1) == 1


def test_entry_age_is_never_negative() -> None:
    assert entry_age_s("99999999999999-0", now_s=0) == 0
    assert entry_age_s(b"1000-5", now_s=3.0) == pytest.approx(2.0)
