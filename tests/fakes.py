"""In-process test doubles that satisfy the stage protocol of SPEC §2."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Any

from omni_runtime.core.types import StageOutput

Behaviour = Callable[[str, Any], Iterable[tuple[Any, bool]]]


class FakeStage:
    """Records what it was submitted and emits `behaviour(rid, data)` as outputs.

    Outputs are queued inside `submit` itself, before it returns: the
    orchestrator must already know the request by then.
    """

    def __init__(self, behaviour: Behaviour | None = None, fail_on: set[str] | None = None):
        self.behaviour = behaviour
        self.fail_on = fail_on or set()
        self.submitted: list[tuple[str, Any]] = []
        self._outputs: asyncio.Queue[StageOutput] = asyncio.Queue()

    async def submit(self, request_id: str, data: Any) -> None:
        if request_id in self.fail_on:
            raise RuntimeError(f"cannot take {request_id}")
        self.submitted.append((request_id, data))
        if self.behaviour is not None:
            for out_data, finished in self.behaviour(request_id, data):
                self.emit(StageOutput(request_id, out_data, finished))

    def emit(self, out: StageOutput) -> None:
        self._outputs.put_nowait(out)

    async def get_output(self) -> list[StageOutput]:
        first = await self._outputs.get()
        batch = [first]
        while not self._outputs.empty():
            batch.append(self._outputs.get_nowait())
        return batch


def split_words(_rid: str, prompt: str) -> Iterable[tuple[Any, bool]]:
    words = prompt.split()
    for i, w in enumerate(words):
        yield w, i == len(words) - 1


def upper_all(_rid: str, words: list[str]) -> Iterable[tuple[Any, bool]]:
    yield [w.upper() for w in words], True


def prefix_wav(_rid: str, chunks: list[list[str]]) -> Iterable[tuple[Any, bool]]:
    items = [w for chunk in chunks for w in chunk]
    for i, w in enumerate(items):
        yield f"wav:{w}", i == len(items) - 1


def seed_stages() -> list[FakeStage]:
    return [FakeStage(split_words), FakeStage(upper_all), FakeStage(prefix_wav)]


def identity_forward(_next: int, _prompt: Any, prev: list[Any]) -> Any:
    return prev


class Gate:
    """A build_payload that blocks on the payload `blocked_on` until released."""

    def __init__(self, blocked_on: Any) -> None:
        self.blocked_on = blocked_on
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, snap: Any) -> Any:
        if snap == self.blocked_on:
            self.entered.set()
            assert self.release.wait(10)
        return snap
