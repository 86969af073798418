"""Error hierarchy: callers decide between retrying and giving up by class alone."""

from __future__ import annotations


class OmniError(Exception):
    """Base of every error the runtime raises on purpose."""


class RecoverableError(OmniError):
    """Transient: retrying later (or on another replica) may succeed."""


class FatalError(OmniError):
    """Retrying will not help: bad configuration, bad input, a dead dependency."""


class TransportError(RecoverableError):
    """Redis could not be reached or answered with an error after bounded retries."""


class CodecError(FatalError, ValueError):
    """Bytes that are not a valid message: malformed msgpack or failed validation."""


class ConfigError(FatalError):
    """A pipeline file or setting is invalid; the message names the field and the file."""


class StartupTimeoutError(FatalError, TimeoutError):
    """A process did not become ready in time; the message names the setting to raise."""


class RequestTimeoutError(OmniError, TimeoutError):
    """No output of a request arrived within the request timeout (OMNI_REQUEST_TIMEOUT_S)."""
