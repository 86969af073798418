"""Responses kept in the deployment's Redis outlive the `serve` that answered them: one
killed (SIGKILL) after its answer, the conversation goes on on another replica; a
background response outlives its client (read on, to its end, on another replica) and one
whose server was killed mid-answer reads as failed; a draining server finishes those it
runs and those it queued. On real processes and a real redis-server."""

from __future__ import annotations

import contextlib
import signal
from typing import Any

import pytest

from tests.e2e.realtime_deployment import Deployment, front_door
from tests.waiting import wait_for_async

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


LONG = " ".join(f"w{k}" for k in range(150))
"""A prompt the demo says in ~3 s (150 tokens at 50 a second)."""


async def test_a_background_response_outlives_its_client_but_not_its_server(
    demo: Deployment, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with contextlib.contextmanager(front_door)(demo, tmp_path_factory, "kept-b", {}) as door:
        async with door.client() as oai:
            stream = await oai.responses.create(
                model="omni", input=LONG, background=True, stream=True
            )
            first: list[Any] = []
            async for ev in stream:
                first.append(ev)
                if len(first) == 8:
                    break  # its client goes away mid-answer
            await stream.close()
        response_id = first[0].response.id
        async with demo.client() as other:  # another replica reads it on, to its end
            resumed = await other.responses.retrieve(response_id, stream=True, starting_after=7)
            rest: list[Any] = [ev async for ev in resumed]
        assert [ev.sequence_number for ev in first + rest] == list(range(8 + len(rest)))
        assert rest[-1].type == "response.completed"
        deltas = [ev.delta for ev in first + rest if ev.type == "response.output_text.delta"]
        assert "".join(deltas).split() == LONG.split()
        async with door.client() as oai:
            begun = await oai.responses.create(model="omni", input=LONG, background=True)
        door.serve.proc.send_signal(signal.SIGKILL)  # its server dies mid-answer
        door.serve.proc.wait(30)
    got: list[Any] = []

    async def ended() -> bool:  # polled, as a client of a background response does
        got[:] = [await oai.responses.retrieve(begun.id)]
        return bool(got[0].status != "in_progress")

    async with demo.client() as oai:
        await wait_for_async(ended, 30, lambda: "still in progress", every_s=0.05)
    assert got[0].status == "failed" and got[0].error is not None
    assert "stopped" in got[0].error.message


async def test_a_draining_server_finishes_its_background_responses(
    demo: Deployment, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGTERM with a background response running, another queued behind it (the server
    runs one request at a time) and no client waiting for either: the drain waits for the
    first as for a request in flight, runs the second, then `serve` exits 0."""
    env = {"OMNI_DRAIN_S": "20", "OMNI_MAX_INFLIGHT": "1"}
    with contextlib.contextmanager(front_door)(demo, tmp_path_factory, "kept-c", env) as door:
        async with door.client() as oai:
            begun = await oai.responses.create(model="omni", input=LONG, background=True)
            queued = await oai.responses.create(model="omni", input="And then", background=True)
        assert (begun.status, queued.status) == ("in_progress", "queued")
        door.serve.proc.send_signal(signal.SIGTERM)
        assert door.serve.proc.wait(40) == 0, door.serve.log()
    async with demo.client() as oai:
        done = await oai.responses.retrieve(begun.id)
        after = await oai.responses.retrieve(queued.id)
    assert done.status == "completed", done
    assert done.output_text.split() == LONG.split()
    assert after.status == "completed" and after.output_text == "And then", after
