"""A value other than the default for every setting, each one a pipeline still runs with:
what the tests of a setting's path from `run` and `serve` to their processes give.

A setting added to `Settings` and not here fails those tests: each one's path is checked."""

from __future__ import annotations

from typing import Any

NON_DEFAULT: dict[str, Any] = {
    "redis_url": "redis://127.0.0.1:6399/0",
    "redis_cluster": "no",
    "namespace": "every-setting",
    "chunk_ttl_s": 301,
    "client_stream_ttl_s": 601,
    "stream_maxlen": 100_001,
    "read_count": 255,
    "block_ms": 99,
    "max_message_bytes": 64 * 1024 * 1024 + 1,
    "startup_timeout_s": 31.5,
    "request_timeout_s": 301.5,
    "deadline_s": 599.5,
    "input_timeout_s": 61.5,
    "worker_max_concurrency": 255,
    "worker_quick_call_ms": 1.5,
    "client_buffer_outputs": 4097,
    "heartbeat_interval_s": 0.9,
    "heartbeat_ttl_s": 6.5,
    "orchestrator_lease_ttl_s": 5.5,
    "orchestrator_idle_block_ms": 3999,
    "durable_requests": False,
    "max_deliveries": 4,
    "retry_initial_s": 0.02,
    "retry_max_s": 2.5,
    "retry_attempts": 21,
    "trace_file": "/tmp/every-setting.trace",
    "trace": True,
    "trace_ttl_s": 3601,
    "responses_ttl_s": 3599,
    "conversations_ttl_s": 86_400,
    "metrics_port": 9399,
    "watchdog_s": 29.5,
    "max_deadline_s": 3599.5,
    "deadline_grace_s": 2.5,
    "worker_poison_strikes": 3,
    "engine_start_timeout_s": 599.5,
    "engine_health_interval_s": 4.5,
    "drain_s": 4.5,
    "stats_interval_s": 4.5,
    "scale_target_per_replica": 17,
    "scale_to_zero": True,
    "realtime_max_event_bytes": 2 * 1024 * 1024,
    "realtime_max_buffer_s": 119.5,
    "realtime_max_session_s": 3599.5,
    "realtime_idle_timeout_s": 599.5,
    "realtime_max_send_bytes": 16 * 1024 * 1024,
    "realtime_send_timeout_s": 9.5,
    "realtime_max_sessions": 64,
}


def flag(name: str, value: Any) -> list[str]:
    """The command-line flag giving `value` to the setting `name`."""
    option = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [option] if value else ["--no-" + option[2:]]
    return [option, str(value)]
