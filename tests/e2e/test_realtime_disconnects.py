"""`/v1/realtime` on the synthetic demo: however the client goes (a close, a TCP reset, a
close after it stopped reading, a socket that takes nothing), the session ends at once and
its request is aborted at every stage (the workers' heartbeats, `status`'s source, say
so). The official client where it can, a raw socket (`raw_realtime`) where it cannot."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.raw_realtime import RawClient
from tests.e2e.realtime_client import Heard, recv, take, user_text
from tests.e2e.realtime_deployment import (
    KEY,
    LONG_TEXT,
    Deployment,
    front_door,
)
from tests.waiting import wait_for, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]


async def test_a_disconnect_aborts_the_response_at_every_stage(demo: Deployment) -> None:
    cancelled = demo.metric("omni_realtime_responses_cancelled_total")
    conn = await demo.client().realtime.connect(model="omni").enter()
    await conn.conversation.item.create(item=user_text(LONG_TEXT))
    before = demo.stage_counts()
    await conn.response.create()
    heard = Heard()
    while "response.output_audio.delta" not in heard.kinds:
        take(heard, await asyncio.wait_for(recv(conn), 10))
    await conn.close()

    wait_until(lambda: demo.dropped_since(before), 20, demo.explain_stages)
    assert demo.metric("omni_realtime_responses_cancelled_total") == cancelled + 1
    assert demo.metric("omni_realtime_sessions_open") == 0


def server_send_queue(server_port: int, client_port: int) -> int:
    """Bytes the kernel holds unsent on the server's side of one loopback connection."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1].split(":")[1], fields[2].split(":")[1]
        if (int(local, 16), int(remote, 16)) == (server_port, client_port):
            return int(fields[4].split(":")[0], 16)
    return 0


@pytest.mark.parametrize("when", ["idle", "opening", "streaming", "not_reading"])
def test_a_reset_connection_ends_the_session_and_its_request(demo: Deployment, when: str) -> None:
    """The client vanishes with a TCP reset, no closing handshake: the session ends and
    its request is aborted at every stage, at once, whatever the session was doing."""
    cancelled = demo.metric("omni_realtime_responses_cancelled_total")
    before = demo.stage_counts()
    client = RawClient(demo.serve.port, KEY, rcvbuf=4096 if when == "not_reading" else None)
    assert client.recv()["type"] == "session.created"
    if when != "idle":
        client.send({"type": "conversation.item.create", "item": user_text(LONG_TEXT)})
        client.send({"type": "response.create"})
    if when == "opening":  # the response has started: its request is being submitted
        client.recv_until("response.created")
    elif when == "streaming":
        client.recv_until("response.output_audio.delta")
    elif when == "not_reading":  # the server's sends back up: its writer waits on the socket
        client_port = client.sock.getsockname()[1]
        wait_until(lambda: server_send_queue(demo.serve.port, client_port) > 32 * 1024, 20)
    client.reset()
    reset_at = time.monotonic()
    wait_until(lambda: demo.metric("omni_realtime_sessions_open") == 0, 5)
    ended_s = time.monotonic() - reset_at
    if when != "idle":

        def dropped() -> bool:
            if when == "opening":  # it may have been aborted before a stage took it
                return not any(counts.in_flight for counts in demo.stage_counts().values())
            return demo.dropped_since(before)

        # the module's shared deployment may still be ending an earlier test's request
        wait_until(dropped, 15, demo.explain_stages)
        assert demo.metric("omni_realtime_responses_cancelled_total") == cancelled + 1
    print(f"{when}: session ended {ended_s:.3f} s after the reset,"
          f" every stage clear {time.monotonic() - reset_at:.3f} s after")  # fmt: skip
    assert ended_s < 2.0, f"the session outlived its client by {ended_s:.1f} s"


async def test_a_close_from_a_client_that_stopped_reading_ends_the_session_at_once(
    demo: Deployment,
) -> None:
    """The client stops reading mid-answer, then closes: the server ends the session and
    aborts the request as soon as the close frame arrives (the client's own close waits
    for the server's reply behind the audio it did not read, up to its close timeout: 2 s
    here, 10 s by default)."""
    cancelled = demo.metric("omni_realtime_responses_cancelled_total")
    before = demo.stage_counts()
    conn = await demo.client().realtime.connect(model="omni").enter()
    conn._connection.close_timeout = 2  # websockets' own (openai's options do not list it)
    await conn.conversation.item.create(item=user_text(LONG_TEXT))
    await conn.response.create()
    heard = Heard()
    while "response.output_audio.delta" not in heard.kinds:
        take(heard, await asyncio.wait_for(recv(conn), 10))
    client_port = conn._connection.transport.get_extra_info("sockname")[1]
    await wait_for(lambda: server_send_queue(demo.serve.port, client_port) > 32 * 1024, 20)
    closing = asyncio.ensure_future(conn.close())
    closed_at = time.monotonic()
    await wait_for(lambda: demo.metric("omni_realtime_sessions_open") == 0, 5)
    ended_s = time.monotonic() - closed_at

    await wait_for(lambda: demo.dropped_since(before), 5, demo.explain_stages)
    dropped_s = time.monotonic() - closed_at
    assert demo.metric("omni_realtime_responses_cancelled_total") == cancelled + 1
    await closing
    print(f"session ended {ended_s:.3f} s, every stage clear {dropped_s:.3f} s after the close;"
          f" the client's close took {time.monotonic() - closed_at:.3f} s")  # fmt: skip
    assert ended_s < 2.0


@pytest.fixture(scope="module")
def impatient(demo: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A front door to the same deployment that waits 1 s for a client to take an event."""
    yield from front_door(
        demo, tmp_path_factory, "impatient", {"OMNI_REALTIME_SEND_TIMEOUT_S": "1"}
    )


def test_a_client_that_takes_nothing_ends_its_session_and_its_request(
    impatient: Deployment,
) -> None:
    """Frozen, or gone without a reset: its socket takes no event for
    OMNI_REALTIME_SEND_TIMEOUT_S, well before the outbox's 8 MiB would fill, and the
    request it started is aborted at every stage rather than run for nobody."""
    before = impatient.stage_counts()
    client = RawClient(impatient.serve.port, KEY, rcvbuf=4096)
    try:
        assert client.recv()["type"] == "session.created"
        client.send({"type": "conversation.item.create", "item": user_text(LONG_TEXT)})
        client.send({"type": "response.create"})
        client.recv_until("response.created")
        # ~7 MB of echoes: more than the kernel's socket buffers take, so a send waits
        flood = user_text("y" * 30_000)
        for _ in range(120):
            client.send({"type": "conversation.item.create", "item": flood})
        started = time.monotonic()
        wait_until(lambda: impatient.metric("omni_realtime_sessions_open") == 0, 20)
        ended_s = time.monotonic() - started

        # the module's shared deployment may still be ending an earlier test's request
        wait_until(lambda: impatient.dropped_since(before), 15, impatient.explain_stages)
    finally:
        client.close()
    print(f"session ended {ended_s:.3f} s after the client's last event")
    assert "took no event for 1 s" in impatient.serve.log()
