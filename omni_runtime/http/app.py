"""The FastAPI app: routes, API-key and origin checks, error handlers, body limit, CORS,
lifespan."""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, FastAPI, Header
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from omni_runtime.http.audio import PCM16_RATE
from omni_runtime.http.conversations import conversations_router
from omni_runtime.http.errors import (
    ApiError,
    BodyLimit,
    error_response,
    install_error_handlers,
    out_of_memory,
    shutting_down,
)
from omni_runtime.http.gateway import Gateway
from omni_runtime.http.realtime import realtime_router
from omni_runtime.http.responses import responses_router
from omni_runtime.http.routes import REQUEST_ID_HEADER, chat_router
from omni_runtime.http.schemas import ModelCard, ModelList
from omni_runtime.http.sockets import OriginCheck, RealtimeSettings
from omni_runtime.http.speech import speech_router
from omni_runtime.http.speech_stream import speech_stream_router
from omni_runtime.http.transcriptions import PATH as UPLOAD_PATH
from omni_runtime.http.transcriptions import transcriptions_router
from omni_runtime.observe.prometheus import metrics_asgi_app

PLAYGROUND_SCRIPTS = ("talk.js", "mic-worklet.js")
"""The playground's microphone panel and its AudioWorklet, served at /playground/<name>."""


def _static(name: str) -> str:
    return resources.files("omni_runtime.http").joinpath(f"static/{name}").read_text("utf-8")


def api_key_check(gateway: Gateway) -> Any:
    """A dependency: `Authorization: Bearer <one of OMNI_API_KEYS>`, or no check without keys."""
    keys = [k.get_secret_value().encode() for k in gateway.serve.api_keys]

    async def check(authorization: Annotated[str | None, Header()] = None) -> None:
        if not keys:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing bearer API key (Authorization: Bearer <key>)")
        given = token.strip().encode()
        matched = False
        for key in keys:  # no early exit: timing tells nothing about which key is close
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")

    return check


def origin_check(gateway: Gateway) -> OriginCheck:
    """A Realtime handshake from a web page (browsers send `Origin`) opens a session only
    from the server's own pages (the playground) or an origin of `OMNI_CORS_ORIGINS`;
    one with no `Origin` is no browser's, and the API key decides."""
    allowed = set(gateway.serve.cors_origins)

    def refused(headers: Mapping[str, str]) -> ApiError | None:
        origin = headers.get("origin")
        if origin is None or "*" in allowed or origin in allowed:
            return None
        if urlsplit(origin).netloc.lower() == headers.get("host", "").lower():
            return None
        return ApiError(
            403,
            f"a page of {origin} may not open a Realtime session here: "
            "add its origin to OMNI_CORS_ORIGINS",
            code="origin_not_allowed",
        )

    return refused


class AsgiEndpoint:
    """An ASGI app as a route's endpoint: Starlette calls it as is (a plain function it would
    wrap as a request handler), so `/metrics` answers at its own path, with no redirect."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def create_app(gateway: Gateway) -> FastAPI:
    """The app over one gateway; its OmniClients live as long as the app's lifespan."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(
        title=f"omni-runtime: {', '.join(gateway.served)}",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.gateway = gateway
    install_error_handlers(app)
    started = int(time.time())
    page = _static("playground.html")
    scripts = {name: _static(name) for name in PLAYGROUND_SCRIPTS}
    talks = [s for s in gateway.served.values() if s.outputs.takes_text]
    shown = talks[0] if talks else gateway.first
    """The playground's pipeline: the first that takes text (typed turns on one that hears)."""
    listens = [
        s for s in gateway.served.values()
        if s.outputs.input == "audio" and s.outputs.audio_stage is not None
    ]  # fmt: skip
    """The microphone's: the first that takes speech and answers aloud (`/v1/realtime`)."""

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/playground/config", include_in_schema=False)
    async def playground_config() -> dict[str, Any]:
        """What the page cannot know: the model name, the audio rate, whether keys are needed."""
        return {
            "model": shown.name,
            "sample_rate": PCM16_RATE,  # streamed pcm16, whatever rate the pipeline makes
            "audio": shown.outputs.audio_stage is not None,
            "takes_text": shown.outputs.takes_text,
            "auth_required": bool(gateway.serve.api_keys),
            "talk_model": listens[0].name if listens else None,
        }

    @app.get("/playground/{name}", include_in_schema=False)
    async def playground_script(name: str) -> Response:
        if name not in scripts:
            return error_response(ApiError(404, f"no playground file {name!r}"))
        return Response(
            scripts[name],
            media_type="text/javascript",
            headers={"Cache-Control": "no-cache"},
        )

    @app.get("/health")
    async def health() -> dict[str, str]:
        """The process is up (it may not be ready)."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """The orchestrator and a worker of every stage up to the last final one beat, in
        every pipeline served, and Redis takes writes; not once the drain has begun."""
        if gateway.stopping:
            return error_response(shutting_down())
        oom = gateway.out_of_memory()
        if oom is not None:
            return error_response(out_of_memory(oom))
        missing = await gateway.missing()
        if missing:
            return error_response(
                ApiError(503, f"not ready: no {', '.join(missing)}", code="not_ready")
            )
        names = list(gateway.served)
        return JSONResponse({"status": "ready", "pipeline": names[0], "pipelines": names})

    # The gateway's registry (its OmniClient's counters, HTTP-side TTFT/TTFP); no API key,
    # like /health: Prometheus scrapes it, and it holds no request content.
    exporter = AsgiEndpoint(metrics_asgi_app(gateway.metrics, {"role": "serve"}))
    app.router.routes.append(Route("/metrics", exporter, methods=["GET"], include_in_schema=False))

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api_key_check(gateway))])

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=started)

    @v1.get("/models")
    async def models() -> ModelList:
        """Each pipeline served, by the name a request's `model` gives."""
        return ModelList(data=[card(name) for name in gateway.served])

    @v1.get("/models/{model_id}")
    async def model(model_id: str) -> ModelCard:
        return card(gateway.model(model_id).name)

    v1.include_router(chat_router(gateway))
    v1.include_router(responses_router(gateway))
    v1.include_router(conversations_router(gateway))
    v1.include_router(speech_router(gateway))
    v1.include_router(transcriptions_router(gateway))
    app.include_router(v1)
    realtime = gateway.settings.part(RealtimeSettings)
    checks = (api_key_check(gateway), origin_check(gateway))  # its own: a socket's headers
    app.include_router(realtime_router(gateway, *checks, realtime))
    app.include_router(speech_stream_router(gateway, *checks, realtime))
    uploads = {UPLOAD_PATH: gateway.serve.max_upload_bytes}
    app.add_middleware(BodyLimit, max_bytes=gateway.serve.max_body_bytes, paths=uploads)
    if gateway.serve.cors_origins:  # outermost: a preflight needs no key, an error gets CORS too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=gateway.serve.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Omni-Trace"],
            expose_headers=[REQUEST_ID_HEADER, "X-Sample-Rate", "Retry-After"],
            max_age=600,
        )
    return app
