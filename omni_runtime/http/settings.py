"""Settings of the HTTP server: env `OMNI_*` (like the runtime's) or command-line flags."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ORIGIN = re.compile(
    r"https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?"
)
"""A web origin as a browser sends it in `Origin`: scheme, host, optional port."""


class ServeSettings(BaseSettings):
    # `ignore`: the runtime's own OMNI_* variables share the prefix.
    model_config = SettingsConfigDict(env_prefix="OMNI_", extra="ignore")

    host: Annotated[str, Field(min_length=1, max_length=255)] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    api_keys: Annotated[list[SecretStr], NoDecode, Field(max_length=1024)] = Field(
        default_factory=list
    )
    """`OMNI_API_KEYS=k1,k2`: any of them opens /v1/* as `Authorization: Bearer <key>`."""
    allow_unauthenticated: bool = False
    """Needed to bind a non-loopback address without API keys."""
    max_inflight: Annotated[int, Field(gt=0, le=100_000)] = 64
    """Requests this server runs at once; more get 429 instead of queueing unboundedly."""
    max_body_bytes: Annotated[int, Field(gt=0, le=64 * 1024 * 1024)] = 1024 * 1024
    max_upload_bytes: Annotated[int, Field(gt=0, le=64 * 1024 * 1024)] = 16 * 1024 * 1024
    """Largest body of `/v1/audio/transcriptions` (the multipart upload, ~8.7 minutes of
    16 kHz 16-bit mono WAV); other requests get `max_body_bytes`."""
    max_prompt_chars: Annotated[int, Field(gt=0, le=1_000_000)] = 32_768
    ready_cache_s: Annotated[float, Field(ge=0, le=60)] = 0.5
    """Readiness is re-checked in Redis at most this often (it scans heartbeat keys)."""
    cors_origins: Annotated[list[str], NoDecode, Field(max_length=64)] = Field(default_factory=list)
    """`OMNI_CORS_ORIGINS=https://app.example,http://localhost:3000` (or `*`): web pages of
    those origins may call the API (CORS) and open a Realtime session; without it only
    the server's own pages (the playground) and clients that are not browsers may."""

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        """A variable's comma list (`NoDecode`: not read as JSON)."""
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins_are_origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"{origin!r} is not an origin: scheme://host[:port], no path "
                    "(e.g. https://app.example), or *"
                )
        return origins

    @field_validator("api_keys")
    @classmethod
    def _keys_not_trivial(cls, keys: list[SecretStr]) -> list[SecretStr]:
        for key in keys:
            if len(key.get_secret_value()) < 8:
                raise ValueError("every API key needs at least 8 characters")
        return keys

    @classmethod
    def load(cls, **given: Any) -> ServeSettings:
        """From `OMNI_*` variables under the flags `given`; a bad value is a `ConfigError` of
        one line naming its variable (and flag), never echoing an API key."""
        try:
            return cls(**given)
        except ValidationError as e:
            from omni_runtime.errors import ConfigError

            raise ConfigError(describe_serve_error(e)) from None

    def check_exposure(self) -> None:
        """Refuse to serve a non-loopback address without keys unless told so explicitly."""
        if self.api_keys or self.allow_unauthenticated or is_loopback(self.host):
            return
        from omni_runtime.errors import ConfigError

        raise ConfigError(
            f"refusing to serve {self.host} without API keys: set OMNI_API_KEYS, "
            "bind 127.0.0.1, or pass --allow-unauthenticated"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


FLAGS = frozenset({"host", "port", "max_inflight", "allow_unauthenticated"})
"""The serve settings that are flags too (`http/flags.py`); the rest are variables only."""
SECRET = frozenset({"api_keys"})


def describe_serve_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        where = f"OMNI_{field.upper()}"
        if field in FLAGS:
            where += f" (--{field.replace('_', '-')})"
        message = str(err["msg"]).removeprefix("Value error, ")
        shown = "" if field in SECRET else f", got {err.get('input')!r}"
        parts.append(f"{where}: {message}{shown}")
    return "invalid serve settings: " + "; ".join(parts)
