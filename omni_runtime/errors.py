"""Error hierarchy: callers decide between retrying and giving up by class alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


ERROR_CODE_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"
"""A machine-readable error code, as OpenAI's (`context_length_exceeded`): what a stage's
refusal of a request may carry on the wire (`stage_api.RequestRefused`)."""


class OmniError(Exception):
    """Base of every error the runtime raises on purpose."""


class RecoverableError(OmniError):
    """Transient: retrying later (or on another replica) may succeed."""


class FatalError(OmniError):
    """Retrying will not help: bad configuration, bad input, a dead dependency."""


class TransportError(RecoverableError):
    """Redis could not be reached or answered with an error after bounded retries."""


class RedisOutOfMemoryError(TransportError):
    """Redis refused a write: it is at `maxmemory` and may evict nothing (`noeviction`).

    Its own kind, because retrying at once will not help: memory comes back as requests
    end and their entries are deleted, or when maxmemory is raised. A submission gets it
    at once (shed load); the message always starts with `OOM_MESSAGE`."""


OOM_MESSAGE = "Redis is out of memory"
"""How every error caused by Redis refusing writes for memory begins (`maxmemory`)."""


class CodecError(FatalError, ValueError):
    """Bytes that are not a valid message: malformed msgpack or failed validation."""


class ConfigError(FatalError):
    """A pipeline file or setting is invalid; the message names the field and the file."""


NO_REDIS_URL = "no Redis URL: set OMNI_REDIS_URL or pass --redis-url"


class StartupTimeoutError(FatalError, TimeoutError):
    """A process did not become ready in time; the message names the setting to raise."""


class RequestTimeoutError(OmniError, TimeoutError):
    """No output of a request arrived within the request timeout (OMNI_REQUEST_TIMEOUT_S)."""


def in_words(e: ValidationError) -> str:
    """A validation error as one line, `field: reason; field: reason` (its `str` spans
    lines, with links to pydantic's site, which an error final carries to the client)."""
    return "; ".join(
        f"{'.'.join(map(str, x['loc'])) or 'value'}: {x['msg']}"
        for x in e.errors(include_url=False)
    )
