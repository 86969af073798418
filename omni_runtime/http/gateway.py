"""The bridge between HTTP requests and the pipelines: one OmniClient per pipeline served.

It finds a request's pipeline by its `model` (the pipeline's name), admits it
(readiness, the in-flight bound), turns its OrchOutputs into text and audio events
using the pipeline file's `outputs` mapping, and makes sure a request the HTTP side
gives up on is aborted at every stage.

One pipeline is served in the namespace given (`OMNI_NAMESPACE`); several are each
in one of their own, `<namespace>.<pipeline name>` (`namespace_for`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Protocol

from redis.exceptions import RedisError

from omni_runtime.client.client import OmniClient, RequestTimeoutError
from omni_runtime.core.tool_calls import calls_in
from omni_runtime.core.types import FinishReason, OrchOutput, TokenUsage
from omni_runtime.errors import CodecError, ConfigError, OmniError, RedisOutOfMemoryError
from omni_runtime.http.audio import AudioFormatError, as_pcm
from omni_runtime.http.errors import ApiError, out_of_memory, shutting_down
from omni_runtime.http.events import (
    SHUTTING_DOWN,
    AudioEvent,
    Event,
    FailureEvent,
    TextEvent,
    ToolCallEvent,
)
from omni_runtime.http.response_store import ConversationStore, ResponseStore
from omni_runtime.http.settings import ServeSettings
from omni_runtime.http.transcripts import text_of
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.timings import RequestTimer
from omni_runtime.pipeline import OutputsConfig, PipelineConfig
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.liveness import stage_has_live_replica
from omni_runtime.settings import Settings

log = logging.getLogger(__name__)


def outputs_of(pipeline: PipelineConfig) -> OutputsConfig:
    if pipeline.outputs is None:
        raise ConfigError(
            f"pipeline {pipeline.name!r} has no `outputs` field: name its text_stage and/or "
            "audio_stage (and sample_rate) to serve it over HTTP"
        )
    return pipeline.outputs


NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""What `Settings.namespace` allows."""


def namespace_for(namespace: str, pipelines: Sequence[PipelineConfig], name: str) -> str:
    """The namespace pipeline `name` runs in: the one given when it is served alone, else
    `<namespace>.<name>` (its orchestrator and workers must run there too)."""
    if len(pipelines) == 1:
        return namespace
    combined = f"{namespace}.{name}"
    if not NAMESPACE.match(combined):
        raise ConfigError(
            f"pipeline {name!r} served with others runs in namespace {combined!r}, which is "
            "not one: a pipeline name of letters, digits, '_', '.', '-' is needed, and at "
            "most 64 characters with the namespace"
        )
    return combined


def check_served(pipelines: Sequence[PipelineConfig], namespace: str) -> list[str]:
    """Fail at start-up for what no request could fix: a pipeline without `outputs`, two of
    one name (a request's `model` chooses one), a name no namespace can hold. Returns the
    namespaces, in order."""
    names = [p.name for p in pipelines]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"pipelines served at once need different names: {twice} twice")
    for p in pipelines:
        outputs_of(p)
    return [namespace_for(namespace, pipelines, n) for n in names]


class Drainable(Protocol):
    def drain(self) -> None:
        """Close once no response runs (at once if none does)."""


class Served:
    """One pipeline this server fronts: what it outputs and takes, its client, its readiness."""

    def __init__(self, pipeline: PipelineConfig, settings: Settings) -> None:
        self.pipeline = pipeline
        self.outputs = outputs_of(pipeline)
        self.settings = settings
        """The server's settings in this pipeline's namespace."""
        self.client: OmniClient | None = None
        self.ready_at = -1.0
        self.missing: list[str] = ["startup"]

    @property
    def name(self) -> str:
        return self.pipeline.name

    @property
    def default_max_tokens(self) -> int | None:
        """The text stage's own cap on an answer (`options.max_tokens`), if it has one: what
        a request that sets none gets."""
        stage = self.outputs.text_stage
        cap = None if stage is None else self.pipeline.stage(stage).options.get("max_tokens")
        return cap if isinstance(cap, int) and not isinstance(cap, bool) else None


class Gateway:
    def __init__(
        self,
        pipelines: PipelineConfig | Sequence[PipelineConfig],
        settings: Settings,
        clients: RedisClients,
        serve: ServeSettings,
    ) -> None:
        listed = [pipelines] if isinstance(pipelines, PipelineConfig) else list(pipelines)
        namespaces = check_served(listed, settings.namespace)
        self.served = {
            p.name: Served(p, settings.model_copy(update={"namespace": ns}))
            for p, ns in zip(listed, namespaces, strict=True)
        }
        """By model name, in the order given: the first is the playground's."""
        self.settings = settings
        self.clients = clients
        self.serve = serve
        self.metrics = Metrics()
        """This process's one registry (its clients count here too), served at GET /metrics."""
        self.timer = RequestTimer(self.metrics)
        """Time to first token / audio and end to end as the HTTP side sees them."""
        self.inflight = 0
        """Requests in flight over every pipeline: `max_inflight` bounds the server."""
        self._aborts: set[asyncio.Task[None]] = set()
        self.stopping = False
        """Set by `stop`: new requests are refused, what runs goes on."""
        self.cut = False
        """Set by `cut_all`: the drain ran out, and no queued response begins."""
        self.sessions: set[Drainable] = set()
        """Realtime connections open: `stop` asks each to close once its response is done."""
        self.background: set[asyncio.Task[None]] = set()
        """Background responses running here (`background.py`): the drain waits for them."""
        self.followers = 0
        """Readers of background responses' events here, each holding a Redis connection."""
        self.queued, self.freed = set[str](), asyncio.Event()
        """Background responses here waiting for a place (`max_inflight` at most; by id), and
        what wakes them, set as a request in flight ends (`background.py`)."""
        self.kept: ResponseStore | None = None
        """The responses this server keeps (`store`), once started."""
        self.conversations: ConversationStore | None = None
        """The conversations (`/v1/conversations`), once started."""

    @property
    def first(self) -> Served:
        return next(iter(self.served.values()))

    def model(self, name: str) -> Served:
        """The pipeline a request's `model` names; 404 (as OpenAI answers) for none."""
        served = self.served.get(name)
        if served is None:
            raise ApiError(
                404, f"the model {name!r} does not exist", param="model", code="model_not_found"
            )
        return served

    async def start(self) -> None:
        for served in self.served.values():
            client = OmniClient(
                served.settings, self.clients, metrics=self.metrics, outputs=served.outputs
            )
            await client.__aenter__()
            served.client = client
        self._probe = self.clients.aio()
        names, ttl_s = self.settings.names, self.settings.responses_ttl_s
        self.kept = ResponseStore(self._probe, names.kept_response, ttl_s, self.metrics)
        self.conversations = ConversationStore(
            self._probe, names.conversation, self.settings.conversations_ttl_s, self.metrics
        )

    async def close(self) -> None:
        if self.background:  # the drain cut them: they end their runs now
            await asyncio.wait(self.background, timeout=2)
        if self._aborts:
            await asyncio.wait(self._aborts, timeout=2)
        started = [s for s in self.served.values() if s.client is not None]
        for served in started:
            assert served.client is not None
            await served.client.close()
            served.client = None
        if started:
            await self._probe.aclose()

    async def missing(self, only: Served | None = None) -> list[str]:
        """What is not up yet (empty: ready), of one pipeline or of all (each named when
        several are served); cached so probes and requests cost no scans."""
        several = only is None and len(self.served) > 1
        missing: list[str] = []
        for served in [only] if only is not None else self.served.values():
            lacking = await self._missing(served)
            missing += [f"{served.name}: {m}" for m in lacking] if several else lacking
        return missing

    async def _missing(self, served: Served) -> list[str]:
        loop = asyncio.get_running_loop()
        if served.client is None:
            return ["http client"]
        if loop.time() - served.ready_at < self.serve.ready_cache_s:
            return served.missing
        names = served.settings.names
        missing: list[str] = []
        try:
            if not await self._probe.exists(names.orchestrator_heartbeat()):
                missing.append("orchestrator")
            stages = 0 if served.settings.scale_to_zero else served.pipeline.last_stage + 1
            for sid in range(stages):  # scaled to zero, a stage's requests wait for it
                if not await stage_has_live_replica(self._probe, names, sid):
                    missing.append(f"stage {sid} worker")
        except (RedisError, OSError) as e:
            missing = [f"redis ({type(e).__name__})"]
        served.missing, served.ready_at = missing, loop.time()
        return missing

    def out_of_memory(self) -> str | None:
        """What Redis said, while it refuses writes for memory (as this server's clients
        last saw it: their own writes, their heartbeats, Redis's count of refusals)."""
        for served in self.served.values():
            if served.client is not None and served.client.out_of_memory is not None:
                return served.client.out_of_memory
        return None

    async def open(
        self,
        served: Served,
        prompt: Any,
        audio: bool,
        trace: bool = False,
        params: dict[str, Any] | None = None,
        text_stage: int | None = None,
        queued: str | None = None,
    ) -> Run:
        """Admit and submit one request; 503 when not ready or Redis is out of memory (with
        `Retry-After`), 429 when at `max_inflight`; `trace`: every process stamps it
        (`X-Omni-Trace: 1`), read by `omni-runtime trace`; `queued`: the request id of a
        background response that waited for a place (`background.py`), run in a drain too;
        `params`: the request's parameters, which every stage receives; with `modalities:
        ["text"]` added when the pipeline speaks but the client wants no audio; `text_stage`:
        the stage whose text the run yields, when not the pipeline's text stage."""
        if self.stopping and (queued is None or self.cut):
            self.metrics.inc("omni_requests_refused_total", reason="shutting down")
            raise shutting_down()
        missing = await self.missing(served)
        if missing:
            self.metrics.inc("omni_requests_refused_total", reason="not ready")
            raise ApiError(503, f"not ready: no {', '.join(missing)}", code="not_ready")
        if self.inflight >= self.serve.max_inflight:
            self.metrics.inc("omni_requests_refused_total", reason="busy")
            raise ApiError(
                429, f"{self.serve.max_inflight} requests in flight; retry later", code="busy"
            )
        client = served.client
        assert client is not None
        if not audio and served.outputs.audio_stage is not None:  # its TTS stages are not run
            params = {**(params or {}), "modalities": ["text"]}
        self.inflight += 1
        try:
            request_id = await client.submit(prompt, queued, trace=trace, params=params)
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
        return Run(self, served, client, request_id, audio, text_stage)

    def stop(self) -> None:
        """The drain begins: refuse what is new (503 `shutting_down`), let what runs finish,
        and close each realtime session as soon as it has no response running."""
        self.stopping = True
        for session in list(self.sessions):
            session.drain()

    def cut_all(self) -> int:
        """The drain ran out: every request in flight ends now with an error its client
        reads (a 503, or an error event in a stream already begun), not a dropped
        connection; each is aborted at every stage."""
        self.cut = True
        cut = sum(s.client.end_all(SHUTTING_DOWN) for s in self.served.values() if s.client)
        if cut:
            log.warning("drain over: %d request(s) still in flight cut", cut)
        return cut

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

    def __init__(
        self,
        gateway: Gateway,
        served: Served,
        client: OmniClient,
        request_id: str,
        audio: bool,
        text_stage: int | None = None,
    ) -> None:
        self.gateway = gateway
        self.served = served
        self.text_stage = served.outputs.text_stage if text_stage is None else text_stage
        self.client = client
        self.request_id = request_id
        self.audio = audio
        self.ended = False
        """The request reached its finished output (or failed): nothing left to abort."""
        self.finish_reason: FinishReason = "stop"
        """Why the text stage's output ended: "length" once it says it hit its limit."""
        self.usage: TokenUsage | None = None
        """The text stage's token counts, if its engine gave them."""
        self._closed = False

    def note_end(self, out: OrchOutput) -> None:
        """What the text stage's finished output says of it: why it ended, its counts."""
        if out.stage_id == self.text_stage:
            self.finish_reason = out.finish_reason or self.finish_reason
            self.usage = out.usage or self.usage

    async def events(self) -> AsyncGenerator[Event, None]:
        out_cfg = self.served.outputs
        first_text = True
        made = 0
        """Calls so far: the next one's index."""
        timer = self.gateway.timer
        timeout_s = self.served.settings.request_timeout_s  # OMNI_REQUEST_TIMEOUT_S
        try:
            async for out in self.client.stream(self.request_id, timeout_s=timeout_s):
                self.ended = out.finished
                timer.output(self.request_id, out.data, out.finished, out.error)
                if out.error is not None:
                    self.ended = True
                    yield FailureEvent.of(out.stage_id, out.error, out.error_code)
                    return
                self.note_end(out)
                if out.stage_id == self.text_stage and (calls := calls_in(out.data)):
                    self.finish_reason = "tool_calls"  # unless its end says otherwise
                    yield ToolCallEvent(calls, made)
                    made += len(calls)
                elif out.stage_id == self.text_stage and out.data is not None:
                    text, timing = text_of(out.data)
                    if text:
                        sep = "" if first_text else out_cfg.text_separator
                        yield TextEvent(sep + text, timing)
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
        self.gateway.freed.set()
        self.gateway.timer.ended(self.request_id)  # no-op once its finished output was timed
        if not self.ended:
            self.gateway.abort_later(self.client, self.request_id)
