"""What a stage's user code looks like: the whole surface stage authors import.

Two shapes of stage code (see docs/stages.md):

* **A function** `fn(data, **options)`: returns one value, or is a (sync or
  async) generator yielding chunks. Yield `Final(x)` to send the last chunk at
  once; otherwise the worker holds one chunk back so it can mark the last one
  finished when the generator ends. `with_last(data)` tells, without delay,
  whether an upstream chunk is the last one.
* **A step engine** (a class, built as `cls(**options)`): `add_request`,
  `step`, `abort`, `has_work`, and optionally `close` and `reset` — for real
  model engines that batch many requests per step (the shape of vLLM's
  `LLMEngine`). After `step()` raises, the worker resets the engine and runs
  the step's requests again to find the one that broke it; it must re-run a
  request alike (seeded per request).
* **An async engine** (a class): `start`, `generate` (an async iterator per
  request), `abort`, `check_health`, `stats`, `close` — for engines that own
  their threads (the shape of vLLM's `AsyncLLM`, llama.cpp's server).

Per-request parameters (`max_tokens`, `voice`, ...) reach stage code that declares a
keyword `params` (a function's, or a step engine's `add_request`): each request's dict,
or None. Stage 0 gets the prompt. A later stage gets `forward_fn`'s value in sequential
mode (by default the list of all the previous stage's chunks) and a
`ChunkStream` of them in streaming mode; both iterate the same way, so the
same code runs in both modes. How the worker drives both shapes lives in
`omni_runtime.worker.engines`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from omni_runtime.core.types import FinishReason
from omni_runtime.core.types import TokenUsage as TokenUsage  # for stage code: `Final.usage`
from omni_runtime.errors import ERROR_CODE_PATTERN, OmniError


@dataclass(frozen=True, slots=True)
class Final:
    """Yield `Final(x)` from a stage generator: x is the request's last chunk, sent at once.

    `finish_reason="length"` says the output stopped at a limit (`max_tokens`) rather than
    where the model ended it: a client is told (OpenAI's `finish_reason: "length"`).
    `usage`: the model's token counts for the request, which the client's `usage` reports
    instead of an estimate."""

    data: Any
    finish_reason: FinishReason | None = None
    usage: TokenUsage | None = None


@dataclass(slots=True)
class EngineOutput:
    request_id: str
    data: Any
    finished: bool
    error: str | None = None
    error_code: str | None = None
    """`RequestRefused.code`, when the request was refused for what it asked."""
    finish_reason: FinishReason | None = None
    """On a finished output: why it ended, as `Final.finish_reason`."""
    usage: TokenUsage | None = None
    """On a finished output: the request's token counts, as `Final.usage`."""


@runtime_checkable
class StageEngine(Protocol):
    """A step-based engine: the worker adds requests and calls `step` while `has_work`."""

    def add_request(self, request_id: str, data: Any) -> None: ...

    def step(self) -> list[EngineOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def has_work(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine holds now: for `status`, metrics and autoscaling."""

    running: int
    waiting: int
    capacity: int
    """Requests it can run at once (its batch slots)."""


class EngineDead(OmniError):
    """Raised by `check_health` (or from `generate`) when the engine can serve nothing more:
    the worker takes its replica out of service instead of failing requests one by one."""


@runtime_checkable
class AsyncStageEngine(Protocol):
    """An engine that owns its own threads or event loop (vLLM's `AsyncLLM`, llama.cpp's
    server): the shape every peer's async engine boundary has.

    `generate` is an async iterator of one request's outputs: each item is a chunk, and
    `Final(x)` marks the last one (else the worker holds one chunk back to mark it).
    `data` is the stage input: the prompt (stage 0), the previous stage's outputs
    (sequential mode) or a `ChunkStream` of them (streaming mode: iterate it with
    `async for`). An exception from `generate` fails that request alone; `abort` must
    free what the request holds (a batch slot, its KV memory) and ignore unknown ids.
    """

    async def start(self) -> None:
        """Load the model; after it returns, `generate` must be ready."""
        ...

    def generate(
        self, request_id: str, data: Any, params: dict[str, Any] | None
    ) -> AsyncIterator[Any]: ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None:
        """Return if healthy; raise (`EngineDead`) if the engine can serve nothing more."""
        ...

    def stats(self) -> EngineStats: ...

    async def close(self) -> None:
        """Release everything; called once, at shutdown (a second call does nothing)."""
        ...


@runtime_checkable
class ClosableEngine(Protocol):
    """An engine with resources to release: `close()` is called once, at shutdown.

    Optional; the worker checks for it once, when it builds the engine.
    """

    def close(self) -> None: ...


@runtime_checkable
class ResettableEngine(Protocol):
    """An engine that can start over after a failed step: `reset()` drops every request it
    holds and whatever state the failed step left, as a new engine would be.

    Optional. After any exception from `step()` (other than `StepFailed`) the worker
    calls it, or without it builds the engine anew (`cls(**options)`, closing the old one),
    then gives the engine the requests of the failed step again (docs/stages.md).
    """

    def reset(self) -> None: ...


class StepFailed(OmniError):
    """Raise from `step()` to say which requests a failed step concerns.

    Only those end with an error, and the engine goes on as it is. After any other
    exception the worker cannot tell which request broke the step: it resets the
    engine and runs the step's requests again, until the one that keeps failing is found.
    """

    def __init__(self, request_ids: Iterable[str], cause: str) -> None:
        super().__init__(cause)
        self.request_ids = list(request_ids)


def takes_params(fn: Callable[..., Any]) -> bool:
    """Whether stage code declares a `params` keyword: it then gets each request's
    parameters (`params=`, a dict or None); code without it runs as before."""
    try:
        return "params" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


MARKS_FINAL_ATTR = "__omni_marks_final__"

F = TypeVar("F", bound=Callable[..., Any])


def marks_final(fn: F) -> F:
    """Declare that a generator stage yields `Final(x)` for its last chunk.

    Its chunks then go out the moment they are yielded, instead of one chunk
    late (the look-ahead a plain generator needs to know which chunk is last).
    If it ends without `Final`, a `None` chunk closes the request.
    """
    setattr(fn, MARKS_FINAL_ATTR, True)
    return fn


PRELOAD_ATTR = "__omni_preload__"


def preloads(loader: Callable[[dict[str, Any]], None]) -> Callable[[F], F]:
    """Declare what a function stage loads once per process (a model, a voice).

    The worker calls `loader(options)` (the stage's options from the pipeline file)
    before it reports ready, so the first request does not wait for the load and a
    load that fails stops the worker at start, not at its first request.
    """

    def mark(fn: F) -> F:
        setattr(fn, PRELOAD_ATTR, loader)
        return fn

    return mark


class RequestRefused(OmniError, ValueError):
    """Raised by stage code for a request it cannot serve as sent (a prompt longer than the
    model's context, audio it cannot read, a parameter out of its range): the request
    fails with the message and `code`, and an HTTP client gets a 400 (the client's fault,
    not worth a retry) instead of a 502. Any other exception is the stage's fault."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        if not re.fullmatch(ERROR_CODE_PATTERN, code):  # the wire would refuse it
            raise ValueError(f"RequestRefused code {code!r}: 1-64 of a-z, 0-9 and _")
        super().__init__(message)
        self.code = code


def refusal_code(e: BaseException) -> str | None:
    """`e.code` when `e` refused the request; None for any other failure."""
    return e.code if isinstance(e, RequestRefused) else None


class RequestAborted(OmniError):
    """Raised inside a stage's input iteration once the request was aborted."""


class ChunkStream:
    """The upstream chunks of one request, in order; filled by the worker as they arrive.

    Iterating blocks for the next chunk (stage code runs on its own thread);
    `async for` waits without blocking its event loop (async engines); `take` never
    blocks (for step engines). `prompt` is the request's prompt, as stage 0 got it: what
    sequential mode's `forward_fn` is given beside the upstream's data.
    """

    def __init__(self, items: Iterable[Any] = (), closed: bool = False, prompt: Any = None) -> None:
        self.prompt = prompt
        self._cv = threading.Condition()
        self._items: list[Any] = list(items)
        self._closed = closed
        self._aborted = False
        self._taken = 0
        self._listeners: list[Callable[[], None]] = []
        """Async iterations waiting on an event loop: each is told of every change."""

    def extend(self, items: Iterable[Any], closed: bool) -> None:
        with self._cv:
            self._items.extend(items)
            self._closed = self._closed or closed
            self._cv.notify_all()
            listeners = list(self._listeners) if self._listeners else None
        if listeners:
            for tell in listeners:
                tell()

    def abort(self) -> None:
        with self._cv:
            self._aborted = True
            self._cv.notify_all()
            listeners = list(self._listeners)
        for tell in listeners:
            tell()

    @property
    def closed(self) -> bool:
        """True once the upstream's last chunk arrived."""
        with self._cv:
            return self._closed

    def rewind(self) -> None:
        """Make `take` start again from the first chunk (the worker's, when it gives the
        request to a reset engine); chunks keep arriving as before."""
        with self._cv:
            self._taken = 0

    def take(self) -> list[Any]:
        """The chunks that arrived since the last `take` (never blocks)."""
        with self._cv:
            new = self._items[self._taken :]
            self._taken = len(self._items)
            return new

    def iter_with_last(self) -> Iterator[tuple[Any, bool]]:
        """Each chunk with whether it is the last one, known as soon as it arrives."""
        i = 0
        while True:
            with self._cv:
                while i >= len(self._items) and not self._closed and not self._aborted:
                    self._cv.wait(0.1)
                if self._aborted:
                    raise RequestAborted("request aborted while waiting for input")
                if i >= len(self._items):
                    return
                item, is_last = self._items[i], self._closed and i == len(self._items) - 1
            i += 1
            yield item, is_last

    def __iter__(self) -> Iterator[Any]:
        for item, _ in self.iter_with_last():
            yield item

    async def aiter_with_last(self) -> AsyncIterator[tuple[Any, bool]]:
        """`iter_with_last` for an event loop: waits for chunks without blocking the loop
        (`extend` and `abort`, on other threads, set an event of this loop's)."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def tell() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(changed.set)

        with self._cv:
            self._listeners.append(tell)
        try:
            i = 0
            while True:
                with self._cv:
                    if self._aborted:
                        raise RequestAborted("request aborted while waiting for input")
                    if i < len(self._items):
                        item, is_last = self._items[i], self._closed and i == len(self._items) - 1
                    elif self._closed:
                        return
                    else:  # cleared under the lock: a change after this check sets it again
                        changed.clear()
                        item = _NOTHING
                if item is _NOTHING:
                    await changed.wait()
                    continue
                i += 1
                yield item, is_last
        finally:
            with self._cv:
                self._listeners.remove(tell)

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for item, _ in self.aiter_with_last():
            yield item


_NOTHING = object()


def with_last(data: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """`(item, is_last)` pairs; for a ChunkStream without waiting for the next chunk."""
    if isinstance(data, ChunkStream):
        yield from data.iter_with_last()
        return
    it = iter(data)
    try:
        held = next(it)
    except StopIteration:
        return
    for item in it:
        yield held, False
        held = item
    yield held, True
