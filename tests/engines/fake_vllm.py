"""A fake of vLLM's `AsyncLLM` with the surface `omni_runtime.engines.vllm` uses, so that
the adapter's own code runs in tests on a machine without a GPU.

Like `AsyncLLM`, `generate(prompt, sampling_params, request_id)` is an async generator of
`RequestOutput`s (DELTA or CUMULATIVE text, as `output_kind` asks), the last one
`finished`; at most `max_num_seqs` requests run at once, the others wait for a slot;
`abort` frees a request's slot and ignores unknown ids; a consumer that stops iterating
aborts its request; `errored`/`dead_error`/`check_health` report a dead engine. What it
generates is scripted: the prompt's words over and over (`reply`), one token per
`token_delay_s`, up to `max_tokens`, cut at a `stop` string. `fail_word` in a prompt
makes that request fail after its first token; `kill()` makes the engine dead.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.engines.vllm import VllmApi


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str
    outputs: list[CompletionOutput]
    finished: bool
    prompt_token_ids: list[int] | None = None
    """One per word of the prompt, on the first output only (the adapter keeps it)."""


class EngineDeadError(RuntimeError):
    """vLLM's error for a dead engine (`vllm.v1.engine.exceptions.EngineDeadError`)."""


def words_forever(prompt: str) -> Iterable[str]:
    words = prompt.split() or ["..."]
    return (f" {w}" for w in itertools.cycle(words))


@dataclass
class FakeAsyncLLM:
    model: str
    max_num_seqs: int = 256
    token_delay_s: float = 0.001
    reply: Callable[[str], Iterable[str]] = words_forever
    fail_word: str = "boom"
    engine_args: dict[str, Any] = field(default_factory=dict)
    seen: dict[str, SamplingParams] = field(default_factory=dict)
    """Each request's sampling parameters, as the adapter built them."""
    aborted: list[str] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    shut_down: int = 0
    _dead: BaseException | None = None
    _slots: asyncio.Semaphore | None = None
    _abort_events: dict[str, asyncio.Event] = field(default_factory=dict)

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException:
        return self._dead or EngineDeadError("engine dead")

    def kill(self, reason: str = "engine core died") -> None:
        """The engine core process died: every request and check fails from now on."""
        self._dead = EngineDeadError(reason)

    async def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead

    async def abort(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            event = self._abort_events.get(rid)
            if event is not None:
                self.aborted.append(rid)
                event.set()

    def shutdown(self) -> None:
        self.shut_down += 1
        self._dead = self._dead or EngineDeadError("engine shut down")

    async def generate(
        self, prompt: str, sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise self._dead
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str here, got {type(prompt).__name__}")
        self.seen[request_id] = sampling_params
        aborted = self._abort_events[request_id] = asyncio.Event()
        slots = self._slots = self._slots or asyncio.Semaphore(self.max_num_seqs)
        try:
            self.waiting += 1
            try:
                await slots.acquire()
            finally:
                self.waiting -= 1
            self.running += 1
            try:
                async for out in self._decode(prompt, sampling_params, request_id, aborted):
                    yield out
            finally:
                self.running -= 1
                slots.release()
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)  # vLLM aborts a request whose consumer left
            raise
        finally:
            del self._abort_events[request_id]

    async def _decode(
        self, prompt: str, sp: SamplingParams, rid: str, aborted: asyncio.Event
    ) -> AsyncIterator[RequestOutput]:
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        limit = sp.max_tokens if sp.max_tokens is not None else 16
        text, sent = "", 0
        tokens = iter(self.reply(prompt))
        for n in itertools.count(1):
            await asyncio.sleep(self.token_delay_s)
            if self._dead is not None:
                raise self._dead
            if aborted.is_set():
                yield self._output(rid, prompt, sp, text, sent, n, "abort")
                return
            if n == 2 and self.fail_word in prompt.split():
                raise RuntimeError(f"injected failure in {rid}")
            token = next(tokens, None)
            reason = None
            if token is None:
                reason = "stop"
            else:
                text += token
                cut = min((text.find(s) for s in stops if s in text), default=-1)
                if cut >= 0:
                    text, reason = text[:cut], "stop"
                elif n >= limit:
                    reason = "length"
            yield self._output(rid, prompt, sp, text, sent, n, reason)
            sent = len(text)
            if reason is not None:
                return

    @staticmethod
    def _output(
        rid: str, prompt: str, sp: SamplingParams, text: str, sent: int, n: int, reason: str | None
    ) -> RequestOutput:
        delta = sp.output_kind == RequestOutputKind.DELTA
        piece = text[sent:] if delta else text
        out = CompletionOutput(0, piece, [n], reason)
        ids = list(range(len(prompt.split()))) if n == 1 else None
        return RequestOutput(rid, prompt, [out], finished=reason is not None, prompt_token_ids=ids)


class FakeVllm:
    """Builds `FakeAsyncLLM`s through the adapter (`api()`), keeping the last one for tests."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.engine: FakeAsyncLLM | None = None
        self.builds = 0

    def build(self, model: str, engine_args: dict[str, Any]) -> FakeAsyncLLM:
        self.builds += 1
        seqs = int(engine_args.get("max_num_seqs", 256))
        self.engine = FakeAsyncLLM(model, seqs, engine_args=engine_args, **self.options)
        return self.engine

    def api(self) -> VllmApi:
        return VllmApi(self.build, SamplingParams, RequestOutputKind.DELTA)


def api() -> VllmApi:
    """For a pipeline file: `api: tests.engines.fake_vllm:api`."""
    return FakeVllm().api()
