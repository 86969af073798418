"""The orchestrator's rules for a request it will not run: each gets one clear error final.

The schema (`messages`) decides what a request may look like; a deployer's limits
(`Settings.max_deadline_s`) are checked here, where the request comes in. An entry the
schema refused is dead-lettered like any malformed entry; when it still names a
request id and a client that can be answered, that client also gets one error final
saying why, instead of waiting for its own timeout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import msgspec
from pydantic import TypeAdapter, ValidationError

from omni_runtime import keys
from omni_runtime.core.types import ReqState, asked_finals
from omni_runtime.errors import CodecError
from omni_runtime.wire import codec
from omni_runtime.wire.messages import ClientId, RequestId, clip_error
from omni_runtime.wire.views import RequestView

_ADDRESS: Final = TypeAdapter(tuple[RequestId, ClientId])
_PAYLOAD: Final = keys.PAYLOAD_FIELD.encode()

DUPLICATE_ID: Final = "duplicate request id"
DEADLINE_TOO_LONG: Final = "deadline too long"
INVALID_REQUEST: Final = "invalid request"
"""The `reason` labels of `omni_requests_refused_total` (few: never the error's text)."""


def refusal(
    cmd: RequestView, max_deadline_s: float, final_stage_ids: frozenset[int]
) -> tuple[str, str] | None:
    """(reason, error) for a valid request this deployment will not run, else None."""
    if cmd.deadline_s is not None and cmd.deadline_s > max_deadline_s:
        error = (
            f"deadline_s={cmd.deadline_s:g} is longer than the longest allowed, "
            f"{max_deadline_s:g} s (OMNI_MAX_DEADLINE_S)"
        )
        return DEADLINE_TOO_LONG, error
    if (unserved := asked_finals(final_stage_ids, cmd.params)) is not None:
        return INVALID_REQUEST, f"{INVALID_REQUEST}: {unserved}"
    return None


def duplicate(request_id: str) -> str:
    return f"{DUPLICATE_ID}: request {request_id!r} is in flight already"


class _Address(msgspec.Struct):
    """The fields that say whom to answer; every other field is skipped, not built."""

    type: Any = None
    request_id: Any = None
    client_id: Any = None


_ADDRESS_OF: Final = msgspec.msgpack.Decoder(_Address)


def answerable(fields: Mapping[bytes, bytes] | None, max_bytes: int) -> tuple[str, str] | None:
    """(request id, client id) of a malformed requests-stream entry that is a request whose
    id and client are themselves valid; None when there is nobody to answer (or the entry
    is past reading at all: nested past msgspec's recursion, ~1,000 levels)."""
    raw = fields.get(_PAYLOAD) if fields else None
    if raw is None or len(raw) > max_bytes:
        return None
    try:
        got = _ADDRESS_OF.decode(raw)
    except (msgspec.MsgspecError, RecursionError):
        return None
    if got.type != "request":
        return None
    try:
        return _ADDRESS.validate_python((got.request_id, got.client_id))
    except ValidationError:
        return None


def invalid(error: str) -> str:
    """The reader's reason, worded as `messages.checked_request` words it at submit."""
    reason = error.removeprefix("invalid request message: ").removeprefix("request.")
    return clip_error(f"{INVALID_REQUEST}: {reason}")


def same_request(prompt: Any, params: Any, cmd: RequestView) -> bool:
    """Whether `cmd` asks for what the live request asked (a retransmitted entry: a
    client's write retried after its reply was lost), compared as encoded."""
    try:
        return codec.encode_decoded((prompt, params)) == codec.encode_decoded(
            (cmd.prompt, cmd.params)
        )
    except CodecError:
        return False


def retransmitted(cmd: RequestView, client_id: str, live: RequestView | ReqState | None) -> bool:
    """The same client asking for what the `live` request under its id asked (the entry
    still queued, or the state registered): its write retried, not a duplicate id."""
    return (
        live is not None
        and client_id == cmd.client_id
        and same_request(live.prompt, live.params, cmd)
    )
