"""A tiny async stage engine: the `AsyncStageEngine` protocol with nothing else in it.

Each request "decodes" its input's words upper-cased, one per `token_delay_ms`, holding
one of `capacity` slots (the others wait); with a `max_tokens` parameter it cycles the
words up to that many, else it says each once, the last as `Final`. A word `boom` fails
its request when reached. `sick_file`: the first replica whose health check renames that
file away (atomic: only one can) is dead from then on — how the fault test turns one of
two replicas unhealthy under load.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator
from typing import Any

from omni_runtime.stage_api import ChunkStream, EngineDead, EngineStats, Final


class TinyAsyncEngine:
    def __init__(
        self,
        capacity: int = 4,
        token_delay_ms: float = 1.0,
        start_delay_ms: float = 0.0,
        sick_file: str | None = None,
    ) -> None:
        self.capacity = capacity
        self.token_delay_s = token_delay_ms / 1000
        self.start_delay_s = start_delay_ms / 1000
        self.sick_file = sick_file
        self.started = False
        self.closed = 0
        self.dead: str | None = None
        self.running = 0
        self.waiting = 0
        self.abort_calls: list[str] = []
        self._slots: asyncio.Semaphore | None = None
        self._stops: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        await asyncio.sleep(self.start_delay_s)  # stands in for a model load
        self._slots = asyncio.Semaphore(self.capacity)
        self.started = True

    async def generate(
        self, request_id: str, data: Any, params: dict[str, Any] | None
    ) -> AsyncIterator[Any]:
        if self.dead is not None or self._slots is None:
            raise EngineDead(self.dead or "not started")
        words = await _words(data)
        limit = (params or {}).get("max_tokens")
        if limit is not None and (not isinstance(limit, int) or limit <= 0):
            raise ValueError(f"max_tokens={limit!r} must be a positive integer")
        stop = self._stops[request_id] = asyncio.Event()
        try:
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
            self.running += 1
            try:
                tokens = itertools.islice(itertools.cycle(words), limit) if limit else iter(words)
                held: str | None = None
                for word in tokens:
                    await asyncio.sleep(self.token_delay_s)
                    if self.dead is not None:
                        raise EngineDead(self.dead)
                    if stop.is_set():
                        return
                    if word == "BOOM":
                        raise ValueError(f"cannot say {word!r}")
                    if held is not None:
                        yield held
                    held = word
                yield Final(held)
            finally:
                self.running -= 1
                self._slots.release()
        finally:
            del self._stops[request_id]

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        stop = self._stops.get(request_id)
        if stop is not None:
            stop.set()

    async def check_health(self) -> None:
        if self.dead is None and self.sick_file is not None:
            try:
                os.rename(self.sick_file, f"{self.sick_file}.{os.getpid()}")
            except FileNotFoundError:
                pass
            else:
                self.dead = f"turned unhealthy ({self.sick_file} taken by pid {os.getpid()})"
        if self.dead is not None:
            raise EngineDead(self.dead)

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running, waiting=self.waiting, capacity=self.capacity)

    async def close(self) -> None:
        """Requests in flight end (quietly, as if aborted); a second call does nothing new."""
        self.closed += 1
        for stop in self._stops.values():
            stop.set()


async def _words(data: Any) -> list[str]:
    if isinstance(data, ChunkStream):
        data = [c async for c in data]
    if isinstance(data, list):
        return [str(w).upper() for chunk in data for w in _split(chunk)]
    return [w.upper() for w in _split(data)]


def _split(chunk: Any) -> list[str]:
    if chunk is None:
        return []
    if isinstance(chunk, list):
        return [str(w) for w in chunk]
    return str(chunk).split()
