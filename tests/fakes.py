"""Seed behaviours for `InMemoryStage` and other in-process test doubles."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from omni_runtime.core.in_memory import InMemoryStage
from omni_runtime.redis_io.streams import ensure_group, ensure_group_sync


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


def seed_stages() -> list[InMemoryStage]:
    return [InMemoryStage(split_words), InMemoryStage(upper_all), InMemoryStage(prefix_wav)]


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


class GroupMakerFailingOnce:
    """Makes a consumer group as the runtime does, except that the first attempt fails as
    if Redis went away again: patched over `ensure_group` / `ensure_group_sync`."""

    def __init__(self) -> None:
        self.failed = False

    def _first_fails(self) -> None:
        if not self.failed:
            self.failed = True
            raise RedisConnectionError("Redis went away again")

    async def ensure(self, client: Any, stream: str, group: str) -> None:
        self._first_fails()
        await ensure_group(client, stream, group)

    def ensure_sync(self, client: Any, stream: str, group: str) -> None:
        self._first_fails()
        ensure_group_sync(client, stream, group)
