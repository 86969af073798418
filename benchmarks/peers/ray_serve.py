"""The omni demo's three stages as Ray Serve deployments: sequential, streaming, per chunk.

Each deployment hosts the very engine `workers/omni.yaml` runs (`workers.omni.Thinker`,
`Talker`, `Code2Wav`, with the pipeline file's options), one replica each, as a Ray user
hosts a batching engine (vLLM on Serve does the same): a thread steps the engine while
it has work, and each request's outputs go to an asyncio queue its handler reads. They
are composed in one of three ways:

* **sequential**: an ingress (one replica too) streams the thinker's tokens to the client as they come
  (stage 0 is a final stage, as in the runtime's sequential mode), then hands the whole
  token list to the talker and its result to code2wav by passing the `DeploymentResponse`
  on (Ray's documented composition: the codes go from replica to replica without the
  ingress awaiting them), and yields all the audio in one message;
* **streaming** (the best Ray Serve allows): Ray cannot pass a stream into another
  deployment's call (`GENERATOR_COMPOSITION_NOT_SUPPORTED_ERROR`, ray-project/ray#57098)
  and a call takes no more input once made, so each stage pulls its own input: code2wav
  (the ingress) makes a streaming call to the talker, which makes one to the thinker;
  each iterates its upstream's `DeploymentResponseGenerator` (`async for`, as Ray's
  handle docs show) and feeds its engine chunk by chunk as they arrive. Three streaming
  calls per request; the text rides along to the ingress. Both engines batch the chunks
  of every request in flight, as the runtime's do;
* **per-chunk** (the other way, measured with `--per-chunk`): an ingress iterates the
  thinker's stream and, per token, makes `code2wav.synth.remote(talker.speak.remote([token]))`
  at once (unary calls chained by reference, the next token's issued without waiting
  for the last one's audio, which it awaits in order). Two Ray requests per chunk, each
  routed, queued and answered on its own: what it costs is in docs/peers.md.

The client is a `DeploymentHandle` from the driver process (`stream=True`), in every
mode. Every streaming method yields lists of `(stage_id, data)` pairs (0 and a token, 2
and a float32 PCM chunk): the pairs ready at once, in one Ray message (`Batch`).
Ray is optional: `pip install -e '.[peers]'`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any, cast

try:
    from ray import serve
    from ray.serve import Deployment
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
except ImportError as e:  # pragma: no cover - the extra is optional
    raise ImportError(
        "the Ray Serve peer needs Ray: pip install -e '.[peers]' (or pip install 'ray[serve]')"
    ) from e

from benchmarks.harness.report import ROOT
from omni_runtime.pipeline import load_pipeline
from omni_runtime.stage_api import ChunkStream
from workers.omni import Code2Wav, Talker, Thinker

OMNI = ROOT / "workers" / "omni.yaml"
MAX_ONGOING = 100_000
"""Per replica: Serve's default (5) would cap the load; the engines batch whatever comes."""
REPLICA: dict[str, Any] = {"num_replicas": 1, "max_ongoing_requests": MAX_ONGOING,
           "ray_actor_options": {"num_cpus": 0}}  # fmt: skip
"""One replica each; num_cpus=0 so eight replicas and the controller fit on two cores."""


def streamed(response: Any) -> DeploymentResponseGenerator[Any]:
    """A call on a `stream=True` handle: Ray's hints give either kind of response."""
    return cast(DeploymentResponseGenerator[Any], response)


def deployment(cls: type) -> Deployment:
    """A class `serve.deployment` decorated: mypy keeps a decorated class's own type."""
    return cast(Deployment, cls)


def stage_options() -> dict[str, dict[str, Any]]:
    """Each stage's options as `workers/omni.yaml` sets them, by stage name."""
    return {s.name: dict(s.options) for s in load_pipeline(OMNI).stages}


Batch = list[tuple[int, Any]]
"""What every streaming method here yields: the `(stage, data)` items ready at once. One
item per yield under light load; when a replica falls behind, one Ray message carries
what queued up, as the runtime batches its own writes."""


async def _drained(queue: asyncio.Queue[Any]) -> AsyncIterator[list[Any]]:
    """The lists put on `queue`, those ready at once joined, until a `None`."""
    while (first := await queue.get()) is not None:
        batch = list(first)
        while not queue.empty():
            more = queue.get_nowait()
            if more is None:
                yield batch
                return
            batch += more
        yield batch


class EngineHost:
    """One step engine on a thread of its own; each request's outputs on an asyncio queue."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._count = 0
        threading.Thread(target=self._run, name="engine", daemon=True).start()

    async def batches(self, data: Any) -> AsyncIterator[list[Any]]:
        """Add a request; yield its outputs' data as the engine's steps make them (those
        ready at once together)."""
        self._loop = asyncio.get_running_loop()
        self._count += 1
        rid = f"r{self._count}"
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[rid] = queue
        self.engine.add_request(rid, data)
        self._wake.set()
        try:
            finished = False
            while not finished:
                batch = []
                for out in [await queue.get()] + [queue.get_nowait() for _ in range(queue.qsize())]:
                    if out.error is not None:
                        raise RuntimeError(out.error)
                    if out.data is not None:
                        batch.append(out.data)
                    finished = finished or out.finished
                if batch:
                    yield batch
        finally:
            self._queues.pop(rid, None)
            self.engine.abort(rid)

    async def collect(self, data: Any) -> list[Any]:
        return [x async for batch in self.batches(data) for x in batch]

    def feed(self, stream: ChunkStream, items: list[Any], closed: bool = False) -> None:
        """More input for a request added with `stream` (a streaming one)."""
        stream.extend(items, closed)
        self._wake.set()

    async def relay(self, upstream: AsyncIterator[Batch], feed_stage: int, out_stage: int
                    ) -> AsyncIterator[Batch]:  # fmt: skip
        """One request streamed through the engine: the upstream's items of `feed_stage`
        feed it as they come, its outputs go on as `out_stage`; text (stage 0) passes
        through too, for the client."""
        stream = ChunkStream()
        out: asyncio.Queue[Batch | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for batch in upstream:
                    self.feed(stream, [data for stage, data in batch if stage == feed_stage])
                    out.put_nowait([(stage, data) for stage, data in batch if stage == 0])
            finally:
                self.feed(stream, [], closed=True)

        async def engine() -> None:
            async for datas in self.batches(stream):
                out.put_nowait([(out_stage, d) for d in datas])

        async for batch in _merged(out, pump(), engine()):
            yield batch

    def _run(self) -> None:
        while True:
            if not self.engine.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            outputs = self.engine.step()
            if outputs and self._loop is not None:
                self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[Any]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)


async def _merged(out: asyncio.Queue[Batch | None], *producers: Any) -> AsyncIterator[Batch]:
    """What the producers put on `out` (those ready at once joined) until all are done;
    re-raises the first failure."""
    tasks = [asyncio.create_task(p) for p in producers]
    done = asyncio.gather(*tasks)
    done.add_done_callback(lambda _f: out.put_nowait(None))
    try:
        async for batch in _drained(out):
            if batch:
                yield batch
        await done
    finally:
        for t in tasks:
            t.cancel()


@serve.deployment(**REPLICA)
class ThinkerDeployment:
    def __init__(self) -> None:
        self.host = EngineHost(Thinker(**stage_options()["thinker"]))

    async def stream(self, prompt: str) -> AsyncIterator[Batch]:
        async for tokens in self.host.batches(prompt):
            yield [(0, t) for t in tokens]


@serve.deployment(**REPLICA)
class TalkerDeployment:
    def __init__(self) -> None:
        self.host = EngineHost(Talker(**stage_options()["talker"]))

    async def speak(self, tokens: list[Any]) -> list[Any]:
        """The codes of every token given (one per token): all of a request, or one token."""
        return await self.host.collect(tokens)


@serve.deployment(**REPLICA)
class Code2WavDeployment:
    def __init__(self) -> None:
        self.host = EngineHost(Code2Wav(**stage_options()["code2wav"]))

    async def synth(self, chunks: list[Any]) -> list[Any]:
        """One PCM array per talker chunk given."""
        return await self.host.collect(chunks)


@serve.deployment(**REPLICA)
class SequentialIngress:
    def __init__(self, thinker: DeploymentHandle[Any], talker: DeploymentHandle[Any],
                 code2wav: DeploymentHandle[Any]) -> None:  # fmt: skip
        self.thinker = thinker.options(stream=True)
        self.talker, self.code2wav = talker, code2wav

    async def stream(self, prompt: str) -> AsyncIterator[Batch]:
        tokens = []
        async for batch in streamed(self.thinker.stream.remote(prompt)):
            tokens += [t for _stage, t in batch]
            yield batch
        codes = self.talker.speak.remote(tokens)  # passed on by reference, not awaited here
        yield [(2, pcm) for pcm in await self.code2wav.synth.remote(codes)]


@serve.deployment(**REPLICA)
class PerChunkIngress:
    def __init__(self, thinker: DeploymentHandle[Any], talker: DeploymentHandle[Any],
                 code2wav: DeploymentHandle[Any]) -> None:  # fmt: skip
        self.thinker = thinker.options(stream=True)
        self.talker, self.code2wav = talker, code2wav

    async def stream(self, prompt: str) -> AsyncIterator[Batch]:
        out: asyncio.Queue[Batch | None] = asyncio.Queue()
        pending: asyncio.Queue[Any] = asyncio.Queue()  # each token's audio call, in order

        async def text() -> None:
            try:
                async for batch in streamed(self.thinker.stream.remote(prompt)):
                    out.put_nowait(batch)
                    for _stage, token in batch:
                        pending.put_nowait(
                            self.code2wav.synth.remote(self.talker.speak.remote([token]))
                        )
            finally:
                pending.put_nowait(None)

        async def audio() -> None:
            while (call := await pending.get()) is not None:
                out.put_nowait([(2, pcm) for pcm in await call])

        async for batch in _merged(out, text(), audio()):
            yield batch


@serve.deployment(**REPLICA)
class TalkerRelay:
    """The talker streaming each request's tokens through as its upstream's stream brings them."""

    def __init__(self, upstream: DeploymentHandle[Any]) -> None:
        self.upstream = upstream.options(stream=True)
        self.host = EngineHost(Talker(**stage_options()["talker"]))

    async def stream(self, prompt: str) -> AsyncIterator[Batch]:
        async for batch in self.host.relay(streamed(self.upstream.stream.remote(prompt)), 0, 1):
            yield batch


@serve.deployment(**REPLICA)
class Code2WavRelay:
    """Code2wav streaming each request's codes through, and the text on: the ingress."""

    def __init__(self, upstream: DeploymentHandle[Any]) -> None:
        self.upstream = upstream.options(stream=True)
        self.host = EngineHost(Code2Wav(**stage_options()["code2wav"]))

    async def stream(self, prompt: str) -> AsyncIterator[Batch]:
        async for batch in self.host.relay(streamed(self.upstream.stream.remote(prompt)), 1, 2):
            yield batch


MODES = ("sequential", "streaming", "per-chunk")


def app(mode: str) -> Any:
    """The application of one mode, with its own three stage deployments."""
    if mode == "streaming":
        thinker = deployment(ThinkerDeployment).options(name=f"{mode}-thinker").bind()
        return deployment(Code2WavRelay).bind(deployment(TalkerRelay).bind(thinker))
    ingress = deployment({"sequential": SequentialIngress, "per-chunk": PerChunkIngress}[mode])
    stages = [deployment(d) for d in (ThinkerDeployment, TalkerDeployment, Code2WavDeployment)]
    return ingress.bind(*(d.options(name=f"{mode}-{d.name}").bind() for d in stages))
