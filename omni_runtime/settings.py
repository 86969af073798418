"""One settings object, built once at the edge (CLI) and held by the process shells.

A shell hands each of its parts what that part needs, through the part's constructor:
loose values, or the part's own frozen dataclass of settings (`part`). No part below a
shell takes the whole object (`tests/unit/test_layout.py` checks who imports it).

Every field can be set from the environment with the `OMNI_` prefix, e.g.
`OMNI_REDIS_URL=rediss://user:secret@host:6380/0` points every process at one Redis.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from omni_runtime import keys
from omni_runtime.wire import messages

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Part = TypeVar("Part", bound="DataclassInstance")

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class Settings(BaseSettings):
    """Each field's docstring is its `--help` text (`cli.startup.document_fields`; not
    pydantic's `use_attribute_docstrings`, which costs every process ~0.1 s at import)."""

    model_config = SettingsConfigDict(env_prefix="OMNI_", extra="forbid")

    redis_url: str | None = None
    """`redis://` or `rediss://`, with `user:password@` for ACLs; or Redis Sentinel's
    `redis+sentinel://host:port[,host:port...]/service[/db]`. None: `run` starts one."""
    redis_cluster: Literal["auto", "yes", "no"] = "auto"
    """Redis Cluster clients: `auto` asks the server at start-up (any node's URL will do)."""
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
    max_deadline_s: Annotated[
        float, Field(gt=0, le=messages.MAX_DEADLINE_S, allow_inf_nan=False)
    ] = 3600.0
    """The longest deadline a request may ask for: longer is refused with one error, at
    submit and by the orchestrator (at least `deadline_s`; at most a year)."""
    deadline_grace_s: Annotated[float, Field(ge=0, le=3600)] = 2.0
    """Client side: a request with no final this long past its deadline ends at the client,
    with an error saying what it knows (Redis unreachable, out of memory, no answer)."""
    input_timeout_s: PositiveFloat = 60.0
    """Worker side: longest wait for an upstream chunk before the request fails."""
    worker_max_concurrency: Annotated[int, Field(gt=0, le=4096)] = 256
    """Requests one worker runs at once; further inputs wait in the stream."""
    worker_quick_call_ms: Annotated[float, Field(ge=0, le=100)] = 1.0
    """A function stage whose calls average less than this runs them on the worker thread
    that received their inputs instead of a pool thread (0: always the pool)."""
    worker_poison_strikes: Annotated[int, Field(gt=0, le=100)] = 2
    """A step engine's request blamed alone for this many of its failed steps (step()
    raised; the worker resets the engine and runs the step's requests again) ends with an
    error, as the poison; the others go on."""
    engine_start_timeout_s: PositiveFloat = 600.0
    """Longest start of an async engine (its model load) before its worker gives up."""
    engine_health_interval_s: PositiveFloat = 5.0
    """An async engine's `check_health` runs this often and must return within it; one that
    fails takes its replica out of service (the worker exits, its inputs are taken over)."""
    client_buffer_outputs: Annotated[int, Field(gt=0)] = keys.CLIENT_BUFFER_OUTPUTS
    """Outputs a client buffers for one request its consumer does not read; past this the
    request is aborted (one error final) and its buffer freed."""
    heartbeat_interval_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    heartbeat_ttl_s: PositiveFloat | None = None
    """A process whose heartbeat is older than this is taken for dead. Default: derived,
    `max(5, 3 * (heartbeat_interval_s + block_ms / 1000))`, since a reader refreshes its
    heartbeat between blocking reads; set explicitly, it must be at least twice that sum."""
    orchestrator_lease_ttl_s: Annotated[float, Field(ge=0.5, le=300)] = (
        keys.ORCHESTRATOR_LEASE_TTL_S
    )
    """An orchestrator renews its slot's lease every quarter of this; a slot whose lease
    lapsed is taken over by a live orchestrator, which finishes its requests."""
    orchestrator_idle_block_ms: Annotated[int, Field(gt=0, le=4_000)] = 4_000
    """How long an orchestrator's reads block while its slot has nothing in flight (never
    past its lease fence, ¾ of the lease TTL): an idle orchestrator wakes seldom. At most
    a second short of redis-py's 5 s socket timeout. With requests in flight, `block_ms`."""
    durable_requests: bool = True
    """Keep each request's routing state in Redis, so a takeover or restart resumes it.
    Off: a dead orchestrator's requests in flight end on their clients' timeouts."""
    max_deliveries: Annotated[int, Field(gt=0, le=1000)] = 3
    """An input delivered more often than this (replicas died on it) is dead-lettered and
    its request ends with an error, instead of taking down replica after replica."""
    retry_initial_s: PositiveFloat = 0.01
    """First delay after a failed Redis operation; doubles per failure up to `retry_max_s`."""
    retry_max_s: PositiveFloat = 2.0
    retry_attempts: Annotated[int, Field(gt=0, le=1000)] = 20
    """Writes give up after this many failures (≈ 30 s with the defaults); reads never do."""
    trace_file: Path | None = None
    """Append event stamps (see `omni_runtime.observe.tracing`) to this file; None: tracing off."""
    trace: bool = False
    """Record every request's event stamps in Redis (`<ns>:trace:<id>`) for `omni-runtime trace`."""
    trace_ttl_s: PositiveInt = 3600
    """How long a request's trace stays in Redis after its last stamp."""
    responses_ttl_s: Annotated[int, Field(ge=0, le=30 * 24 * 3600)] = keys.RESPONSE_TTL_S
    """`serve`: how long a response asked with `store` (OpenAI's default) is kept for
    `previous_response_id` and `GET /v1/responses/{id}`; 0: none is kept."""
    conversations_ttl_s: Annotated[int, Field(gt=0, le=365 * 24 * 3600)] = keys.CONVERSATION_TTL_S
    """`serve`: how long a conversation (`/v1/conversations`) is kept after its last use."""
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Serve Prometheus metrics on this port at /metrics; 0: off."""
    drain_s: Annotated[float, Field(ge=0, le=3600)] = 5.0
    """On SIGTERM: a worker takes no new input, finishes what it holds within this and hands
    back the rest (another replica runs it), then exits 0; `serve` stops accepting and
    finishes its open streams within this. Keep it under a pod's grace period."""
    stats_interval_s: Annotated[float, Field(gt=0, le=300)] = 5.0
    """How often the orchestrator reads the streams into its gauges (backlog, in flight,
    capacity, the desired-replicas hint) and publishes its stats for `status`."""
    scale_target_per_replica: Annotated[int, Field(gt=0, le=1_000_000)] | None = None
    """Requests (queued + in flight) one replica should carry: the desired-replicas hint is
    `ceil((backlog + in flight) / this)`. None: the stage's worker max concurrency."""
    scale_to_zero: bool = False
    """Stages may have no live worker (an autoscaler scaled them to zero): their requests wait
    in the stream, within their deadlines, instead of failing with "no live worker"; `serve`
    is ready with an orchestrator alone."""
    watchdog_s: Annotated[float, Field(ge=0)] = 30.0
    """A loop (an orchestrator slot's, a worker's scheduler or I/O thread) with work in hand
    that has not gone around for this long stops its process, which gives back its lease
    first (`omni_runtime/watchdog.py`); 0: off."""

    realtime_max_event_bytes: Annotated[int, Field(gt=0, le=16 * 1024 * 1024)] = 1024 * 1024
    """`/v1/realtime` and speech streams: the largest client event (a WebSocket message);
    larger ones get an `error` event and are dropped (the socket stays open)."""
    realtime_max_buffer_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    """`/v1/realtime`: the most input audio one turn may hold (24 kHz PCM16) before a commit."""
    realtime_max_session_s: Annotated[float, Field(gt=0, le=86_400)] = 1800.0
    """`/v1/realtime` and speech streams: a session ends (the socket closes) this long after
    it opened."""
    realtime_idle_timeout_s: Annotated[float, Field(gt=0, le=86_400)] = 300.0
    """`/v1/realtime` and speech streams: a session with no client event and nothing running
    for it (a response, speech to send) for this long ends."""
    realtime_max_send_bytes: Annotated[int, Field(gt=0, le=1024 * 1024 * 1024)] = 8 * 1024 * 1024
    """`/v1/realtime` and speech streams: server events queued for a client that does not
    read them; past this the session ends instead of memory growing."""
    realtime_max_sessions: Annotated[int, Field(gt=0, le=100_000)] = 128
    """`/v1/realtime` and speech streams: sessions one `serve` holds open at once; one more
    is refused (429, `too_many_sessions`): each may hold ~14 MiB (its audio buffer and last
    spoken turn, 60 s each, and `realtime_max_send_bytes`), open or idle."""
    realtime_send_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    """`/v1/realtime` and speech streams: a server event the client's socket has not taken
    for this long ends the session (a client that stopped reading, froze, or vanished
    without a reset)."""

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str | None) -> str | None:
        if url is None:
            return None
        scheme = urlsplit(url).scheme
        if scheme in ("redis+sentinel", "rediss+sentinel"):
            from omni_runtime.sentinel_url import parse_sentinel_url

            parse_sentinel_url(url)  # a ValueError names what is wrong
        elif scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                "redis_url must start with redis://, rediss://, unix:// or redis+sentinel://, "
                f"got {url!r}"
            )
        return url

    @model_validator(mode="after")
    def _deadline_within_its_limit(self) -> Settings:
        if not self.deadline_s <= self.max_deadline_s:
            raise ValueError(
                f"OMNI_DEADLINE_S={self.deadline_s:g} is longer than "
                f"OMNI_MAX_DEADLINE_S={self.max_deadline_s:g}"
            )
        return self

    @model_validator(mode="after")
    def _heartbeat_outlives_its_refresh(self) -> Settings:
        refresh_s = self.heartbeat_interval_s + self.block_ms / 1000
        if self.heartbeat_ttl_s is None:
            self.heartbeat_ttl_s = max(float(keys.HEARTBEAT_TTL_S), 3 * refresh_s)
        elif self.heartbeat_ttl_s < 2 * refresh_s:
            raise ValueError(
                f"OMNI_HEARTBEAT_TTL_S={self.heartbeat_ttl_s:g} is shorter than twice "
                f"OMNI_HEARTBEAT_INTERVAL_S + OMNI_BLOCK_MS/1000 ({refresh_s:g} s): live "
                "processes would be taken for dead"
            )
        return self

    @property
    def heartbeat_ttl_ms(self) -> int:
        """The heartbeat keys' TTL, for `SET ... PX` (whole milliseconds)."""
        assert self.heartbeat_ttl_s is not None  # set by the validator
        return int(self.heartbeat_ttl_s * 1000)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags, then `OMNI_*` variables, then the settings file (`--settings-file`)."""
        return (
            init_settings,
            env_settings,
            YamlConfigSettingsSource(settings_cls),
            file_secret_settings,
        )

    @classmethod
    def load(
        cls,
        cli_source: CliSettingsSource[Any] | None = None,
        settings_file: str | Path | None = None,
    ) -> Settings:
        """Build the settings at the edge; a bad value is a `ConfigError` naming its variable."""
        from omni_runtime.errors import ConfigError

        settings_cls = cls
        if settings_file is not None:
            if not Path(settings_file).is_file():
                raise ConfigError(f"settings file {settings_file} does not exist")
            config = SettingsConfigDict(**{**cls.model_config, "yaml_file": settings_file})
            settings_cls = type("FileSettings", (cls,), {"model_config": config})
        try:
            return settings_cls(_cli_settings_source=cli_source)  # type: ignore[call-arg]
        except ValidationError as e:
            raise ConfigError(describe_settings_error(e)) from None
        except (yaml.YAMLError, ValueError, TypeError, AttributeError) as e:
            if settings_file is None:
                raise
            # the file's own fault: not YAML, not UTF-8, or YAML but not a mapping
            raise ConfigError(describe_file_error(settings_file, e)) from None

    def require_redis_url(self) -> str:
        if self.redis_url is None:
            from omni_runtime.errors import NO_REDIS_URL, ConfigError

            raise ConfigError(NO_REDIS_URL)
        return self.redis_url

    @property
    def names(self) -> keys.Names:
        return keys.Names(self.namespace)

    def part(self, cls: type[Part], **also: Any) -> Part:
        """The settings of one part of a process: `cls` is the part's frozen dataclass,
        each field named as the setting it takes; `also` gives its fields that are not
        settings (a shared `RetrySettings`)."""
        given = {f.name: getattr(self, f.name) for f in fields(cls) if f.name not in also}
        return cls(**given, **also)


def describe_settings_error(e: ValidationError) -> str:
    """Name what the user sets (`OMNI_DEADLINE_S` / `--deadline-s`), not the Python field."""
    parts = []
    for err in e.errors():
        if not err["loc"]:  # a rule between settings: its message names them
            parts.append(err["msg"].removeprefix("Value error, "))
            continue
        field = str(err["loc"][0])
        where = f"OMNI_{field.upper()} (--{field.replace('_', '-')})"
        parts.append(f"{where}: {err['msg']}, got {err.get('input')!r}")
    return "invalid settings: " + "; ".join(parts)


def describe_file_error(path: str | Path | None, e: Exception) -> str:
    """One line for a settings file that cannot be read as a mapping of settings."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        why = f"not valid YAML: {e.problem} at line {mark.line + 1}, column {mark.column + 1}"
    elif isinstance(e, UnicodeDecodeError):
        why = f"not UTF-8 text (byte at offset {e.start})"
    elif isinstance(e, yaml.YAMLError):
        why = f"not valid YAML: {' '.join(str(e).split())}"
    else:
        why = "not a mapping of settings (`deadline_s: 30`, one per line)"
    return f"settings file {path}: {why}"
