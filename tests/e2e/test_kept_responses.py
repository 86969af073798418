"""Responses kept in the deployment's Redis outlive the `serve` that answered them: one
killed (SIGKILL) after its answer, the conversation goes on on another replica, on real
processes and a real redis-server."""

from __future__ import annotations

import contextlib
import signal
from typing import Any

import pytest

from tests.e2e.realtime_deployment import Deployment, front_door

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]


async def test_a_conversation_goes_on_after_the_server_that_began_it_died(
    demo: Deployment, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with contextlib.contextmanager(front_door)(demo, tmp_path_factory, "kept-a", {}) as first_door:
        async with first_door.client() as oai:
            first = await oai.responses.create(model="omni", input="Hello there")
        first_door.serve.proc.send_signal(signal.SIGKILL)
        first_door.serve.proc.wait(30)
    async with demo.client() as oai:
        second = await oai.responses.create(
            model="omni", input="Go on", previous_response_id=first.id
        )
        pages = oai.responses.input_items.list(second.id, order="asc")
        read: list[Any] = [item.to_dict() async for item in pages]
        again = await oai.responses.retrieve(first.id)
    assert second.status == "completed" and second.output_text == "Go on"  # the demo echoes
    assert [(item["role"], item["content"][0]["text"]) for item in read] == [
        ("user", "Hello there"), ("assistant", first.output_text), ("user", "Go on"),
    ]  # fmt: skip
    assert again.output_text == first.output_text
