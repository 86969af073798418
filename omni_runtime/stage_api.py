"""What a stage's user code looks like, and how the worker drives it.

Two shapes of stage code (see docs/stages.md):

* **A function** `fn(data, **options)`: returns one value, or is a (sync or
  async) generator yielding chunks. Yield `Final(x)` to send the last chunk at
  once; otherwise the worker holds one chunk back so it can mark the last one
  finished when the generator ends. `with_last(data)` tells, without delay,
  whether an upstream chunk is the last one.
* **A step engine** (a class, built as `cls(**options)`): `add_request`,
  `step`, `abort`, `has_work` — for real model engines that batch many
  requests per step.

Stage 0 gets the prompt. A later stage gets `forward_fn`'s value in sequential
mode (by default the list of all the previous stage's chunks) and a
`ChunkStream` of them in streaming mode; both iterate the same way, so the
same code runs in both modes.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from omni_runtime.errors import OmniError
from omni_runtime.pipeline import StageConfig, resolve_entry

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Final:
    """Yield `Final(x)` from a stage generator: x is the request's last chunk, sent at once."""

    data: Any


@dataclass(slots=True)
class EngineOutput:
    request_id: str
    data: Any
    finished: bool
    error: str | None = None


@runtime_checkable
class StageEngine(Protocol):
    """A step-based engine: the worker adds requests and calls `step` while `has_work`."""

    def add_request(self, request_id: str, data: Any) -> None: ...

    def step(self) -> list[EngineOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def has_work(self) -> bool: ...


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


class RequestAborted(OmniError):
    """Raised inside a stage's input iteration once the request was aborted."""


class ChunkStream:
    """The upstream chunks of one request, in order; filled by the worker as they arrive.

    Iterating blocks for the next chunk (stage code runs on its own thread);
    `take` never blocks (for step engines).
    """

    def __init__(self, items: Iterable[Any] = (), closed: bool = False) -> None:
        self._cv = threading.Condition()
        self._items: list[Any] = list(items)
        self._closed = closed
        self._aborted = False
        self._taken = 0

    def extend(self, items: Iterable[Any], closed: bool) -> None:
        with self._cv:
            self._items.extend(items)
            self._closed = self._closed or closed
            self._cv.notify_all()

    def abort(self) -> None:
        with self._cv:
            self._aborted = True
            self._cv.notify_all()

    @property
    def closed(self) -> bool:
        """True once the upstream's last chunk arrived."""
        with self._cv:
            return self._closed

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


class GeneratorEngine:
    """Runs a plain function or generator stage per request on a bounded thread pool."""

    def __init__(
        self,
        fn: Callable[..., Any],
        options: dict[str, Any],
        max_concurrency: int,
        wake: Callable[[], None],
    ) -> None:
        self._fn = fn
        self._marks_final = bool(getattr(fn, MARKS_FINAL_ATTR, False))
        self._options = options
        self._wake = wake
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="stage")
        self._lock = threading.Lock()
        self._outputs: list[EngineOutput] = []
        self._aborted: set[str] = set()
        self._inputs: dict[str, Any] = {}

    def add_request(self, request_id: str, data: Any) -> None:
        with self._lock:
            self._aborted.discard(request_id)
            self._inputs[request_id] = data
        self._pool.submit(self._run, request_id, data)

    def step(self) -> list[EngineOutput]:
        with self._lock:
            out, self._outputs = self._outputs, []
        return out

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._outputs)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborted.add(request_id)
            data = self._inputs.pop(request_id, None)
            self._outputs = [o for o in self._outputs if o.request_id != request_id]
        if isinstance(data, ChunkStream):
            data.abort()

    def close(self) -> None:
        with self._lock:
            streams = [d for d in self._inputs.values() if isinstance(d, ChunkStream)]
            self._aborted.update(self._inputs)
        for s in streams:
            s.abort()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- on a pool thread ------------------------------------------------------

    def _emit(self, request_id: str, data: Any, finished: bool, error: str | None = None) -> bool:
        """Queue one output; False once the request was aborted (stop producing)."""
        with self._lock:
            if request_id in self._aborted:
                return False
            self._outputs.append(EngineOutput(request_id, data, finished, error))
            if finished:
                self._inputs.pop(request_id, None)
        self._wake()
        return True

    def _run(self, request_id: str, data: Any) -> None:
        try:
            result = self._fn(data, **self._options)
            if inspect.isasyncgen(result):
                asyncio.run(_collect_async(result, request_id, self._emit, not self._marks_final))
                return
            if inspect.iscoroutine(result):
                result = asyncio.run(result)
            if inspect.isgenerator(result):
                self._drain(request_id, result)
            else:
                self._emit(request_id, result, True)
        except RequestAborted:
            return
        except Exception as e:
            log.exception("stage code failed for %r", request_id)
            self._emit(request_id, None, True, error=f"{type(e).__name__}: {e}")

    def _drain(self, request_id: str, gen: Iterator[Any]) -> None:
        """Emit each chunk, holding one back unless the code marks its last with `Final`."""
        sink = _LastChunkSink(request_id, self._emit, hold=not self._marks_final)
        try:
            for item in gen:
                if not sink.push(item):
                    return
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()
        sink.end()


class _LastChunkSink:
    """One chunk of look-ahead, so the last chunk can be marked finished — unless the
    stage is `marks_final`, whose chunks go out the moment they are yielded."""

    _EMPTY = object()

    def __init__(
        self, request_id: str, emit: Callable[[str, Any, bool], bool], hold: bool = True
    ) -> None:
        self.request_id = request_id
        self.emit = emit
        self.hold = hold
        self.held: Any = self._EMPTY
        self.done = False

    def push(self, item: Any) -> bool:
        """False: stop producing (aborted, or `Final` already sent)."""
        if self.held is not self._EMPTY and not self.emit(self.request_id, self.held, False):
            return False
        self.held = self._EMPTY
        if isinstance(item, Final):
            self.done = True
            self.emit(self.request_id, item.data, True)
            return False
        if not self.hold:
            return self.emit(self.request_id, item, False)
        self.held = item
        return True

    def end(self) -> None:
        """The generator is exhausted: its last chunk (or a `None`) closes the request."""
        if self.done:
            return
        last = None if self.held is self._EMPTY else self.held
        self.emit(self.request_id, last, True)


async def _collect_async(
    agen: Any, request_id: str, emit: Callable[[str, Any, bool], bool], hold: bool
) -> None:
    sink = _LastChunkSink(request_id, emit, hold)
    try:
        async for item in agen:
            if not sink.push(item):
                return
    finally:
        await agen.aclose()
    sink.end()


def load_engine(
    stage: StageConfig,
    source_dir: Any,
    max_concurrency: int,
    wake: Callable[[], None],
) -> StageEngine:
    """A class entry is a step engine (`cls(**options)`); a callable is wrapped."""
    entry = resolve_entry(stage.entry, source_dir)
    if inspect.isclass(entry):
        engine = entry(**stage.options)
        if not isinstance(engine, StageEngine):
            from omni_runtime.errors import ConfigError

            raise ConfigError(
                f"stage {stage.id} entry {stage.entry!r} is a class but not a StageEngine "
                "(add_request, step, abort, has_work)"
            )
        return engine
    return GeneratorEngine(entry, stage.options, max_concurrency, wake)
