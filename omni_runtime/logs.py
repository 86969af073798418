"""Logging for every process: plain text for people, one JSON object per line for machines.

A record about a request carries its id (`extra={"request_id": rid}`); the JSON
format puts it in its own field so log search can follow one request.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
