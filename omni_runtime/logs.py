"""Logging for every process: plain text for people, one JSON object per line for machines.

A record about a request carries its id (`extra=for_request(rid)`, i.e.
`extra={"request_id": rid}`); the JSON format puts it in its own field so log
search can follow one request, the text format prints it as `[rid]` before the
message.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(request_tag)s%(message)s"


def for_request(request_id: str) -> dict[str, str]:
    """The `extra=` of a log call about one request."""
    return {"request_id": request_id}


class TextFormatter(logging.Formatter):
    """The text format: a record with a request id shows it as `[rid] ` before its message."""

    def __init__(self, fmt: str = _TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        record.__dict__["request_tag"] = "" if request_id is None else f"[{request_id}] "
        return super().format(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)  # set through `extra=`, if at all
        if request_id is not None:
            doc["request_id"] = request_id
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(level: str = "INFO", log_format: str = "text") -> None:
    """Configure the root logger once, at the edge (the command line)."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else TextFormatter()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
