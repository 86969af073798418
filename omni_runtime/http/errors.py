"""OpenAI-style JSON errors for every failure, and the request-body size limit.

Clients of an OpenAI-compatible server parse `{"error": {message, type, param, code}}`;
FastAPI's defaults (`{"detail": …}`, 422, a bare 500) would break them.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_runtime.http.schemas import ErrorBody, ErrorResponse

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
    504: "server_error",
}


RETRY_AFTER_S = 1
"""What a 429 or 503 tells a client to wait, unless the error knows better."""
OOM_RETRY_AFTER_S = 5
"""Redis out of memory: memory comes back as requests in flight end (seconds), or when
an operator raises maxmemory; retrying sooner is refused again."""


class ApiError(Exception):
    """Raised by routes; becomes an OpenAI error response with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int = RETRY_AFTER_S,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(
            message=message, type=_TYPES.get(status, "server_error"), param=param, code=code
        )
        self.headers: dict[str, str] = {}
        if status == 401:
            self.headers["WWW-Authenticate"] = "Bearer"
        if status in (429, 503):
            self.headers["Retry-After"] = str(retry_after_s)


def out_of_memory(message: str) -> ApiError:
    """503 while Redis refuses writes for memory: the request was not submitted."""
    return ApiError(503, message, code="redis_out_of_memory", retry_after_s=OOM_RETRY_AFTER_S)


def shutting_down() -> ApiError:
    """503 once the server's drain has begun: what runs finishes, nothing new starts."""
    return ApiError(503, "the server is shutting down: retry later", code="shutting_down")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(
        ErrorResponse(error=err.body).model_dump(), status_code=err.status, headers=err.headers
    )


def error_json(err: ApiError) -> bytes:
    return json.dumps(ErrorResponse(error=err.body).model_dump()).encode()


FIELD = re.compile(r"^[a-z_][a-z0-9_]*(\[\])?$")
"""A field's name; a form's list field ends in `[]` (`timestamp_granularities[]`)."""
TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def field_path(loc: Sequence[int | str]) -> list[str]:
    """A validation error's place as the client named it: without `body`, and without the
    union members pydantic names (`voice.constrained-str`, `stop.list[constrained-str].0`)."""
    return [
        str(p)
        for p in loc
        if isinstance(p, int) or (p != "body" and FIELD.match(p) and p not in TYPE_TAGS)
    ]


def unparsable(error: dict[str, Any]) -> str:
    """The message for a body that is not JSON: the parser's reason and where it stopped."""
    loc = error.get("loc", ())
    at = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
    reason = (error.get("ctx") or {}).get("error") or error.get("msg") or "unparsable"
    return f"the request body is not valid JSON: {reason}{at}"


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def on_validation(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        first: dict[str, Any] = errors[0] if errors else {}
        if first.get("type") == "json_invalid":  # its loc is a character position, no field
            return error_response(ApiError(400, unparsable(first), code="invalid_json"))
        loc = field_path(first.get("loc", ()))
        message = "; ".join(
            f"{'.'.join(field_path(e.get('loc', ()))) or 'body'}: {e.get('msg')}"
            for e in errors[:5]
        )
        return error_response(
            ApiError(
                400, message or "invalid request", param=".".join(loc) or None, code="invalid_value"
            )
        )

    async def on_http(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error on %s %s: %r", request.method, request.url.path, exc)
        return error_response(ApiError(500, "internal server error", code="internal_error"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


class BodyLimit:
    """Reads the request body up front, refusing (413) one larger than `max_bytes`, or than
    the limit `paths` gives its path (an upload's).

    Buffering is bounded by the limit itself; the app then gets the body in one
    message, and later `receive` calls (disconnect notices) pass through.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, paths: dict[str, int] | None = None) -> None:
        self.app = app
        self.default_bytes = max_bytes
        self.paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope.get("path", ""), self.default_bytes)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._refuse(send, limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body was read
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await self._refuse(send, limit)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, limit: int) -> None:
        err = ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        body = error_json(err)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
