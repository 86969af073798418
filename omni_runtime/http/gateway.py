"""The bridge between HTTP requests and the pipeline: one shared OmniClient per process.

It admits requests (readiness, the in-flight bound), turns a request's OrchOutputs
into text and audio events using the pipeline file's `outputs` mapping, and makes
sure a request the HTTP side gives up on is aborted at every stage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from redis.exceptions import RedisError

from omni_runtime.client import OmniClient, RequestTimeoutError
from omni_runtime.errors import CodecError, ConfigError, OmniError, RedisOutOfMemoryError
from omni_runtime.http.audio import AudioFormatError, as_pcm
from omni_runtime.http.errors import ApiError, out_of_memory
from omni_runtime.http.settings import ServeSettings
from omni_runtime.metrics import Metrics
from omni_runtime.observe.timings import RequestTimer
from omni_runtime.pipeline import OutputsConfig, PipelineConfig
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.liveness import stage_has_live_replica
from omni_runtime.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TextEvent:
    text: str


@dataclass(frozen=True, slots=True)
class AudioEvent:
    pcm: npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class FailureEvent:
    message: str
    status: int = 502


Event = TextEvent | AudioEvent | FailureEvent


def outputs_of(pipeline: PipelineConfig) -> OutputsConfig:
    if pipeline.outputs is None:
        raise ConfigError(
            f"pipeline {pipeline.name!r} has no `outputs` field: name its text_stage and/or "
            "audio_stage (and sample_rate) to serve it over HTTP"
        )
    return pipeline.outputs


class Gateway:
    def __init__(
        self,
        pipeline: PipelineConfig,
        settings: Settings,
        clients: RedisClients,
        serve: ServeSettings,
    ) -> None:
        self.pipeline = pipeline
        self.outputs = outputs_of(pipeline)
        self.settings = settings
        self.clients = clients
        self.serve = serve
        self.metrics = Metrics()
        """This process's one registry (its client counts here too), served at GET /metrics."""
        self.timer = RequestTimer(self.metrics)
        """Time to first token / audio and end to end as the HTTP side sees them."""
        self.inflight = 0
        self.client: OmniClient | None = None
        self._aborts: set[asyncio.Task[None]] = set()
        self._ready_at = -1.0
        self._missing: list[str] = ["startup"]

    async def start(self) -> None:
        client = OmniClient(self.settings, self.clients, metrics=self.metrics, outputs=self.outputs)
        await client.__aenter__()
        self.client = client
        self._probe = self.clients.aio()

    async def close(self) -> None:
        if self._aborts:
            await asyncio.wait(self._aborts, timeout=2)
        if self.client is not None:
            await self.client.close()
            self.client = None
            await self._probe.aclose()

    async def missing(self) -> list[str]:
        """What is not up yet (empty: ready); cached so probes and requests cost no scans."""
        loop = asyncio.get_running_loop()
        if self.client is None:
            return ["http client"]
        if loop.time() - self._ready_at < self.serve.ready_cache_s:
            return self._missing
        names = self.settings.names
        missing: list[str] = []
        try:
            if not await self._probe.exists(names.orchestrator_heartbeat()):
                missing.append("orchestrator")
            for sid in range(self.pipeline.last_stage + 1):
                if not await stage_has_live_replica(self._probe, names, sid):
                    missing.append(f"stage {sid} worker")
        except (RedisError, OSError) as e:
            missing = [f"redis ({type(e).__name__})"]
        self._missing, self._ready_at = missing, loop.time()
        return missing

    def out_of_memory(self) -> str | None:
        """What Redis said, while it refuses writes for memory (as this server's client
        last saw it: its own writes, its heartbeat, Redis's count of refusals)."""
        return None if self.client is None else self.client.out_of_memory

    async def open(self, prompt: str, audio: bool, trace: bool = False) -> Run:
        """Admit and submit one request; 503 when not ready or Redis is out of memory (with
        `Retry-After`), 429 when at `max_inflight`.
        `trace`: every process stamps it (`X-Omni-Trace: 1`), read by `omni-runtime trace`."""
        missing = await self.missing()
        if missing:
            self.metrics.inc("omni_requests_refused_total", reason="not ready")
            raise ApiError(503, f"not ready: no {', '.join(missing)}", code="not_ready")
        if self.inflight >= self.serve.max_inflight:
            self.metrics.inc("omni_requests_refused_total", reason="busy")
            raise ApiError(
                429, f"{self.serve.max_inflight} requests in flight; retry later", code="busy"
            )
        assert self.client is not None
        self.inflight += 1
        try:
            request_id = await self.client.submit(prompt, trace=trace)
        except CodecError as e:
            self.inflight -= 1
            raise ApiError(413, str(e), code="request_too_large") from e
        except RedisOutOfMemoryError as e:  # shed at once, with Retry-After
            self.inflight -= 1
            raise out_of_memory(str(e)) from e
        except (OmniError, RedisError) as e:
            self.inflight -= 1
            raise ApiError(503, f"could not submit: {e}", code="unavailable") from e
        self.timer.started(request_id)
        return Run(self, self.client, request_id, audio)

    def abort_later(self, client: OmniClient, request_id: str) -> None:
        """Abort from a `finally` that may be under cancellation: a task of its own."""

        async def abort() -> None:
            try:
                await client.abort(request_id, "http client went away")
            except (OmniError, RedisError) as e:
                log.warning(
                    "abort of %s failed: %r", request_id, e, extra={"request_id": request_id}
                )

        task = asyncio.get_running_loop().create_task(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)


class Run:
    """One admitted request: iterate `events()`, and always `close()` it."""

    def __init__(self, gateway: Gateway, client: OmniClient, request_id: str, audio: bool) -> None:
        self.gateway = gateway
        self.client = client
        self.request_id = request_id
        self.audio = audio
        self.ended = False
        """The request reached its finished output (or failed): nothing left to abort."""
        self._closed = False

    async def events(self) -> AsyncGenerator[Event, None]:
        out_cfg = self.gateway.outputs
        first_text = True
        timer = self.gateway.timer
        timeout_s = self.gateway.settings.request_timeout_s  # OMNI_REQUEST_TIMEOUT_S
        try:
            async for out in self.client.stream(self.request_id, timeout_s=timeout_s):
                self.ended = out.finished
                timer.output(self.request_id, out.data, out.finished, out.error)
                if out.error is not None:
                    self.ended = True
                    yield FailureEvent(f"stage {out.stage_id}: {out.error}")
                    return
                if out.stage_id == out_cfg.text_stage and out.data is not None:
                    text = out.data if isinstance(out.data, str) else str(out.data)
                    if text:
                        yield TextEvent(text if first_text else out_cfg.text_separator + text)
                        first_text = False
                elif out.stage_id == out_cfg.audio_stage and self.audio and out.data is not None:
                    try:
                        pcm = as_pcm(out.data)
                    except AudioFormatError as e:
                        yield FailureEvent(f"stage {out.stage_id}: {e}")
                        return
                    if pcm.size:
                        yield AudioEvent(pcm)
        except RequestTimeoutError as e:
            yield FailureEvent(str(e), status=504)

    def close(self) -> None:
        """Free the slot; abort the request at every stage unless it already ended."""
        if self._closed:
            return
        self._closed = True
        self.gateway.inflight -= 1
        self.gateway.timer.ended(self.request_id)  # no-op once its finished output was timed
        if not self.ended:
            self.gateway.abort_later(self.client, self.request_id)
