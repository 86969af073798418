"""Log lines about a request carry its id, in the text format and in JSON."""

from __future__ import annotations

import json
import logging

import pytest

from omni_runtime.logs import JsonFormatter, TextFormatter, for_request
from tests.unit.test_worker_core import inp, make


def _record(**extra: object) -> logging.LogRecord:
    record = logging.LogRecord(
        "omni_runtime.worker.core", logging.ERROR, __file__, 1, "stage %d failed", (1,), None
    )
    record.__dict__.update(extra)
    return record


def test_a_record_with_a_request_id_shows_it_in_both_formats() -> None:
    text = TextFormatter().format(_record(**for_request("req-42")))
    assert text.endswith(" ERROR omni_runtime.worker.core: [req-42] stage 1 failed")
    doc = json.loads(JsonFormatter().format(_record(request_id="req-42")))
    assert doc["request_id"] == "req-42" and doc["message"] == "stage 1 failed"


def test_a_record_without_one_has_no_tag() -> None:
    assert TextFormatter().format(_record()).endswith("omni_runtime.worker.core: stage 1 failed")
    assert "request_id" not in json.loads(JsonFormatter().format(_record()))


def test_a_failing_request_on_a_worker_logs_its_id(caplog: pytest.LogCaptureFixture) -> None:
    core, _engine = make()
    core.on_input(inp("req-7", [{1, 2}]), now=0)  # a set cannot be encoded: the request fails
    with caplog.at_level(logging.ERROR, logger="omni_runtime.worker.core"):
        core.step()
    assert len(caplog.records) == 2  # the output that cannot travel, the request failing
    for record in caplog.records:
        assert getattr(record, "request_id", None) == "req-7"
    assert "[req-7] stage 1: output cannot be sent" in TextFormatter().format(caplog.records[0])
