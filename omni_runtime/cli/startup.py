"""What a command-line process imports at start, and how: its start-up is part of every
`omni-runtime` command, and of `run`'s ~1 s from the command to the first output."""

from __future__ import annotations

import sys


def import_redis() -> None:
    """Import redis-py without the OpenTelemetry SDK, which redis-py imports when it is
    installed (~0.1 s of a process's start) for client metrics of its own that nothing
    here turns on. The runtime's trace export (`observe.otel`) imports what it uses itself,
    and the SDK stays importable: it is hidden for this one import only."""
    hidden = "opentelemetry.sdk.metrics"
    if "redis" in sys.modules or hidden in sys.modules:
        return
    sys.modules[hidden] = None  # type: ignore[assignment]  # "not installed", for this import
    try:
        import redis.asyncio  # noqa: F401
    finally:
        del sys.modules[hidden]
