"""One settings object, built once at the edge (CLI) and passed down explicitly.

Every field can be set from the environment with the `OMNI_` prefix, e.g.
`OMNI_REDIS_URL=rediss://user:secret@host:6380/0` points every process at one Redis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from omni_runtime import keys
from omni_runtime.redis_io.backoff import Backoff

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OMNI_", extra="forbid")

    redis_url: str | None = None
    """`redis://` or `rediss://`, with `user:password@` for ACLs. None: `run` starts one."""
    namespace: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")] = (
        "omni"
    )
    chunk_ttl_s: PositiveInt = keys.CHUNK_TTL_S
    client_stream_ttl_s: PositiveInt = keys.CLIENT_STREAM_TTL_S
    stream_maxlen: PositiveInt = keys.STREAM_MAXLEN
    read_count: Annotated[int, Field(gt=0, le=10_000)] = 256
    """Entries taken per XREADGROUP: batching is what makes ~100k msg/s possible."""
    block_ms: Annotated[int, Field(gt=0, le=10_000)] = 100
    """Longest blocking read; bounds how long shutdown waits for a reader."""
    max_message_bytes: PositiveInt = 64 * 1024 * 1024
    startup_timeout_s: PositiveFloat = 30.0
    request_timeout_s: PositiveFloat = 300.0
    """Client side: longest wait for a request's next output."""
    deadline_s: PositiveFloat = 600.0
    """Orchestrator side: a request still running after this long ends with an error."""
    input_timeout_s: PositiveFloat = 60.0
    """Worker side: longest wait for an upstream chunk before the request fails."""
    worker_max_concurrency: Annotated[int, Field(gt=0, le=4096)] = 256
    """Requests one worker runs at once; further inputs wait in the stream."""
    heartbeat_interval_s: PositiveFloat = 1.0
    max_deliveries: Annotated[int, Field(gt=0, le=1000)] = 3
    """An input delivered more often than this (replicas died on it) is dead-lettered and
    its request ends with an error, instead of taking down replica after replica."""
    retry_initial_s: PositiveFloat = 0.01
    """First delay after a failed Redis operation; doubles per failure up to `retry_max_s`."""
    retry_max_s: PositiveFloat = 2.0
    retry_attempts: Annotated[int, Field(gt=0, le=1000)] = 20
    """Writes give up after this many failures (≈ 30 s with the defaults); reads never do."""
    trace_file: Path | None = None
    """Append event stamps (see `omni_runtime.tracing`) to this file; None: tracing off."""

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str | None) -> str | None:
        if url is None:
            return None
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"redis_url must start with redis://, rediss:// or unix://, got {url!r}"
            )
        return url

    def require_redis_url(self) -> str:
        if self.redis_url is None:
            from omni_runtime.errors import ConfigError

            raise ConfigError("no Redis URL: set OMNI_REDIS_URL or pass --redis-url")
        return self.redis_url

    def backoff(self, bounded: bool = False) -> Backoff:
        """The retry policy of one loop: bounded for writes, unbounded for reads."""
        return Backoff(
            self.retry_initial_s, self.retry_max_s, self.retry_attempts if bounded else None
        )

    @property
    def names(self) -> keys.Names:
        return keys.Names(self.namespace)
