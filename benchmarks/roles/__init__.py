"""Child processes of the scenarios, each run as `python -m benchmarks.roles.<role>`.

They answer the coordinator (`benchmarks.harness.procs.RoleProc`) with JSON lines on stdout.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def emit(obj: dict[str, Any]) -> None:
    """One answer to the coordinator: a JSON line on stdout, flushed."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
