"""`InMemoryStage`: the in-process twin of a Redis stage, for tests, demos and benchmarks.

It satisfies `ManagedStage` and records every call, so a test can check what the
orchestrator submitted, acknowledged and aborted without a Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from omni_runtime.core.types import StageOutput

Behaviour = Callable[[str, Any], Iterable[tuple[Any, bool]]]
"""`behaviour(request_id, data)` yields (output data, finished) pairs."""


class InMemoryStage:
    """Records what it was submitted and emits `behaviour(rid, data)` as outputs.

    Outputs are queued inside `submit` itself, before it returns: the orchestrator
    must already know the request by then (SPEC §3). A request in `fail_on` makes
    `submit` raise. Without a behaviour, the caller emits by hand (`emit`).
    """

    def __init__(self, behaviour: Behaviour | None = None, fail_on: set[str] | None = None):
        self.behaviour = behaviour
        self.fail_on = fail_on or set()
        self.submitted: list[tuple[str, Any]] = []
        self.params: dict[str, dict[str, Any]] = {}
        """Each request's parameters, as submitted (for requests that had any)."""
        self.handled: list[StageOutput] = []
        """Outputs the orchestrator reported handled, in order (a durable stage acks them)."""
        self.aborted: list[str] = []
        self.ended: list[str] = []
        """Requests the orchestrator forgot (`request_ended`), in order."""
        self.quiesced = False
        self._outputs: asyncio.Queue[StageOutput] = asyncio.Queue()

    async def submit(
        self, request_id: str, data: Any, params: dict[str, Any] | None = None
    ) -> None:
        if request_id in self.fail_on:
            raise RuntimeError(f"cannot take {request_id}")
        self.submitted.append((request_id, data))
        if params is not None:
            self.params[request_id] = params
        if self.behaviour is not None:
            for out_data, finished in self.behaviour(request_id, data):
                self.emit(StageOutput(request_id, out_data, finished))

    def emit(self, out: StageOutput) -> None:
        self._outputs.put_nowait(out)

    async def get_output(self) -> list[StageOutput]:
        """Wait for one output, then take every other one already queued."""
        batch = [await self._outputs.get()]
        while not self._outputs.empty():
            batch.append(self._outputs.get_nowait())
        return batch

    def submitted_ids(self) -> list[str]:
        return [rid for rid, _data in self.submitted]

    def output_handled(self, out: StageOutput) -> None:
        self.handled.append(out)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def quiesce(self) -> None:
        self.quiesced = True

    def request_ended(self, request_id: str) -> None:
        self.ended.append(request_id)
