"""`/v1/realtime` with the official `openai` client, on the synthetic demo (workers/omni.yaml
in streaming mode), against real processes: turns, barge-in, limits, bad events; and with
a raw socket (`raw_realtime`) for clients that vanish with a reset or stop reading."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import redis
import websockets

from omni_runtime import keys
from omni_runtime.local.launcher import ProcessGroup, child_env
from omni_runtime.observe.redis_stats import read_heartbeats, server_now
from omni_runtime.pipeline import load_pipeline
from tests.e2e.raw_realtime import RawClient
from tests.e2e.realtime_client import (
    CHUNK_BYTES,
    Heard,
    send_speech,
    silence,
    speech,
    take,
    until_done,
)
from tests.e2e.serving import ROOT, ServeProcess
from tests.waiting import wait_for, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]

OMNI = ROOT / "workers" / "omni.yaml"
KEY = "test-key-0123456789"
LONG_TEXT = " ".join(f"word{i}" for i in range(600))
"""~60 s of the demo's audio, its text made over ~12 s: every stage still has it when the
user speaks, even on a busy machine."""


class Deployment:
    def __init__(self, redis_url: str, namespace: str, serve: ServeProcess) -> None:
        self.redis_url, self.namespace, self.serve = redis_url, namespace, serve

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.serve.url}/v1", api_key=KEY, max_retries=0)

    def stage_aborts(self) -> dict[int, tuple[int, int]]:
        """Each stage's workers' (aborted, in flight), as their heartbeats say (`status`)."""
        r = redis.Redis.from_url(self.redis_url)
        out: dict[int, tuple[int, int]] = {}
        try:
            now_s, _ = server_now(r)
            for p in read_heartbeats(r, keys.Names(self.namespace), now_s):
                beat = r.get(p.key) if p.kind == "worker" and p.stage is not None else None
                if beat is None or p.stage is None:
                    continue
                doc = json.loads(beat)
                aborted, running = out.get(p.stage, (0, 0))
                out[p.stage] = (aborted + doc["aborted"], running + doc["in_flight"])
        finally:
            r.close()
        return out

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.serve.url}/metrics", timeout=10).text
        found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def demo(redis_server_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp_path = tmp_path_factory.mktemp("realtime")
    namespace = f"rt{uuid.uuid4().hex[:8]}"
    # workers beat often: the barge-in test reads their abort counts from their heartbeats
    settings = {"OMNI_NAMESPACE": namespace, "OMNI_HEARTBEAT_INTERVAL_S": "0.05"}
    group = ProcessGroup(
        OMNI, load_pipeline(OMNI, mode="streaming"), child_env(redis_server_url, settings)
    )
    group.start()
    args = ("--pipeline", str(OMNI), "--mode", "streaming", "--redis-url", redis_server_url,
            "--namespace", namespace)  # fmt: skip
    env = {"OMNI_API_KEYS": KEY, "OMNI_REALTIME_MAX_EVENT_BYTES": str(64 * 1024)}
    try:
        with ServeProcess(tmp_path / "serve.log", *args, env=env) as serve:
            yield Deployment(redis_server_url, namespace, serve)
    finally:
        group.stop()


def expected_audio_s(text: str) -> float:
    """The demo's audio for `text`: 20 ms per letter of each token."""
    return sum(0.020 * len(t) for t in re.findall(r"\w+|[^\w\s]", text))


async def test_a_text_turn_streams_text_and_24khz_audio(demo: Deployment) -> None:
    async with demo.client().realtime.connect(model="omni") as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        await conn.session.update(session={
            "type": "realtime", "instructions": "Answer briefly.",
            "output_modalities": ["text", "audio"],
            "audio": {"input": {"turn_detection": None}, "output": {"voice": "alloy"}},
        })  # fmt: skip
        updated: Any = await conn.recv()
        assert updated.type == "session.updated"
        assert updated.session.instructions == "Answer briefly."
        assert updated.session.audio.output.voice == "alloy"
        await conn.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Hello, realtime world!"}],
        })  # fmt: skip
        await conn.response.create()
        heard = await until_done(conn)
    assert heard.errors == [] and heard.status == "completed", heard.kinds
    assert heard.text == heard.transcript == "Hello , realtime world !"
    assert heard.kinds.count("response.output_text.delta") == 5
    assert heard.kinds.index("response.created") < heard.kinds.index("response.output_audio.delta")
    samples = np.frombuffer(bytes(heard.audio), "<i2")  # PCM16: whole samples
    assert samples.size == pytest.approx(
        expected_audio_s("Hello, realtime world!") * 24_000, abs=48
    )
    assert np.abs(samples).max() > 1000  # a tone, not silence
    usage = heard.done.response.usage
    assert usage.output_tokens == 5 and usage.total_tokens >= usage.output_tokens


async def test_a_wrong_key_gets_an_error_and_the_socket_closes(demo: Deployment) -> None:
    client = openai.AsyncOpenAI(base_url=f"{demo.serve.url}/v1", api_key="wrong-key-123")
    with pytest.raises(Exception) as raised:
        async with client.realtime.connect(model="omni") as conn:
            ev = await conn.recv()
            assert ev.type == "error" and ev.error.code == "invalid_api_key"
            await conn.recv()  # the server closes
    assert isinstance(raised.value, websockets.ConnectionClosed | websockets.InvalidStatus)


async def test_barge_in_cancels_the_response_and_every_stage_drops_it(demo: Deployment) -> None:
    words = speech("Stop, please wait a moment.")
    async with demo.client().realtime.connect(model="omni") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "create_response": False}}}})  # fmt: skip
        await conn.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": LONG_TEXT}]
        })  # fmt: skip
        before = demo.stage_aborts()
        await conn.response.create()
        heard = Heard()
        while "response.output_audio.delta" not in heard.kinds:
            take(heard, await asyncio.wait_for(conn.recv(), 10))
        await send_speech(conn, silence(200) + words, CHUNK_BYTES)
        spoke_at = time.monotonic()
        heard = await until_done(conn, heard)
        assert heard.status == "cancelled", heard.kinds
        assert heard.done.response.status_details.reason == "turn_detected"
        assert "input_audio_buffer.speech_started" in heard.kinds
        assert len(heard.audio) < expected_audio_s(LONG_TEXT) * 24_000  # not all of it played

        def dropped() -> bool:
            now = demo.stage_aborts()
            return all(now[s][0] > before.get(s, (0, 0))[0] and now[s][1] == 0 for s in (0, 1, 2))

        wait_until(dropped, 10)  # every stage was running it, every stage aborted it
        print(f"dropped by every stage within {time.monotonic() - spoke_at:.3f} s of the speech")
        # the next turn starts at once and completes
        await conn.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]
        })  # fmt: skip
        await conn.response.create()
        after = await until_done(conn)
        assert after.status == "completed" and after.transcript == "Go on .", after.kinds
    assert demo.metric("omni_realtime_barge_ins_total") >= 1


async def test_bad_events_each_get_an_error_and_the_session_still_works(demo: Deployment) -> None:
    """1,000 malformed or unknown events, then a turn; the server's memory does not grow with
    them (each is 16 KiB: 16 MiB in all)."""
    pad = "x" * 16 * 1024
    bad = [
        "not json " + pad,
        json.dumps({"type": "no.such.event", "pad": pad}),
        json.dumps(
            {"type": "session.update", "session": {"output_modalities": ["smell"]}, "p": pad}
        ),
        json.dumps({"type": "input_audio_buffer.append", "audio": "!!" + pad}),
        json.dumps([pad]),
    ]
    rss_before = rss_kib(demo.serve.proc.pid)
    async with demo.client().realtime.connect(model="omni") as conn:
        assert (await conn.recv()).type == "session.created"
        ws = conn._connection  # raw frames: the client's own types would refuse these
        errors: list[Any] = []
        for i in range(1000):
            await ws.send(bad[i % len(bad)])
        async with asyncio.timeout(30):
            while len(errors) < 1000:
                ev = await conn.recv()
                assert ev.type == "error", ev.type
                errors.append(ev.error)
        codes = {e.code for e in errors}
        assert codes == {"invalid_json", "unknown_event_type", "invalid_value"}, codes
        await ws.send("x" * (64 * 1024 + 1))  # over OMNI_REALTIME_MAX_EVENT_BYTES
        too_large: Any = await conn.recv()
        assert too_large.error.code == "event_too_large"
        await conn.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Still here?"}]
        })  # fmt: skip
        await conn.response.create()
        heard = await until_done(conn)
    assert heard.status == "completed" and heard.transcript == "Still here ?"
    grown_kib = rss_kib(demo.serve.proc.pid) - rss_before
    assert grown_kib < 8 * 1024, f"serve grew {grown_kib} KiB over 16 MiB of bad events"


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    assert found is not None
    return int(found.group(1))


@pytest.fixture(scope="module")
def tight(demo: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A second front door to the same deployment, with small realtime limits."""
    args = ("--pipeline", str(OMNI), "--mode", "streaming", "--redis-url", demo.redis_url,
            "--namespace", demo.namespace)  # fmt: skip
    env = {
        "OMNI_API_KEYS": KEY,
        "OMNI_REALTIME_MAX_BUFFER_S": "0.5",
        "OMNI_REALTIME_IDLE_TIMEOUT_S": "1",
        "OMNI_REALTIME_MAX_SESSION_S": "3",
        "OMNI_REALTIME_MAX_SEND_BYTES": str(64 * 1024),
    }
    log = tmp_path_factory.mktemp("tight") / "serve.log"
    with ServeProcess(log, *args, env=env) as serve:
        yield Deployment(demo.redis_url, demo.namespace, serve)


async def test_the_input_buffer_is_bounded(tight: Deployment) -> None:
    async with tight.client().realtime.connect(model="omni") as conn:
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        )
        await send_speech(conn, silence(400))
        await send_speech(conn, silence(200))  # 0.6 s > OMNI_REALTIME_MAX_BUFFER_S
        kinds: list[Any] = [await conn.recv() for _ in range(3)]
        assert [e.type for e in kinds] == ["session.created", "session.updated", "error"]
        assert kinds[2].error.code == "input_audio_buffer_full"
        await conn.input_audio_buffer.commit()  # the 0.4 s taken is still there
        committed: Any = await conn.recv()
        assert committed.type == "input_audio_buffer.committed"


async def test_idle_and_long_sessions_end(tight: Deployment) -> None:
    for busy in (False, True):
        started = time.monotonic()  # the server's clocks start after this
        async with tight.client().realtime.connect(model="omni") as conn:
            assert (await conn.recv()).type == "session.created"
            ended: Any = None
            sending = busy
            with pytest.raises(websockets.ConnectionClosed):
                async with asyncio.timeout(10):
                    while True:
                        if sending:  # events every 0.3 s: never idle, ends at the session limit
                            try:
                                await conn.input_audio_buffer.clear()
                            except websockets.ConnectionClosed:
                                sending = False  # closing: what it sent before is still to read
                        try:
                            ev: Any = await asyncio.wait_for(conn.recv(), 0.3)
                        except TimeoutError:
                            continue
                        if ev.type == "error":
                            ended = ev.error
            assert ended is not None and ended.code == "session_ended"
            assert ("session length" if busy else "idle") in ended.message
            assert time.monotonic() - started >= (3 if busy else 1)  # and not sooner


async def test_a_client_that_stops_reading_ends_its_session(tight: Deployment) -> None:
    """Its server events would pile up: the session ends once 64 KiB wait (the kernel's
    socket buffers take a few MiB first), before the session limit, and the server's memory
    stays put. The client is a socket that never reads (websockets' client reads ahead)."""
    rss_before = rss_kib(tight.serve.proc.pid)
    item = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "y" * 30_000}],
    }
    create = json.dumps({"type": "conversation.item.create", "item": item})

    def ended() -> bool:
        return tight.metric("omni_realtime_sessions_open") == 0

    await asyncio.to_thread(never_reading_client, tight.serve.port, [create] * 300, ended)
    grown_kib = rss_kib(tight.serve.proc.pid) - rss_before
    assert grown_kib < 16 * 1024, f"serve grew {grown_kib} KiB for a client not reading"
    assert "did not read its events" in tight.serve.log()


def never_reading_client(port: int, events: list[str], ended: Callable[[], bool]) -> None:
    """Open a session and send `events` (each comes back twice, ~18 MB in all), reading
    nothing after the handshake, and stay connected until `ended` (the kernel may take
    every event into the server's socket buffer: the client must not leave first)."""
    client = RawClient(port, KEY, rcvbuf=4096)
    try:
        client.sock.settimeout(2)  # once the server stops reading, sends block
        try:
            for text in events:
                client.proto.send_text(text.encode())
                client.sock.sendall(b"".join(client.proto.data_to_send()))
        except OSError:  # the server stopped reading: it ended the session
            pass
        wait_until(ended, 30)
    finally:
        client.close()


async def test_a_disconnect_aborts_the_response_at_every_stage(demo: Deployment) -> None:
    cancelled = demo.metric("omni_realtime_responses_cancelled_total")
    conn = await demo.client().realtime.connect(model="omni").enter()
    await conn.conversation.item.create(item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": LONG_TEXT}]
    })  # fmt: skip
    before = demo.stage_aborts()
    await conn.response.create()
    heard = Heard()
    while "response.output_audio.delta" not in heard.kinds:
        take(heard, await asyncio.wait_for(conn.recv(), 10))
    await conn.close()

    def dropped() -> bool:
        now = demo.stage_aborts()
        return all(now[s][0] > before.get(s, (0, 0))[0] and now[s][1] == 0 for s in (0, 1, 2))

    wait_until(dropped, 20)
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
    before = demo.stage_aborts()
    client = RawClient(demo.serve.port, KEY, rcvbuf=4096 if when == "not_reading" else None)
    assert client.recv()["type"] == "session.created"
    if when != "idle":
        client.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": LONG_TEXT}]}})  # fmt: skip
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
        stages = (0, 1, 2)

        def dropped() -> bool:
            now = demo.stage_aborts()
            if when == "opening":  # it may have been aborted before a stage took it
                return all(now.get(s, (0, 0))[1] == 0 for s in stages)
            return all(now[s][0] > before.get(s, (0, 0))[0] and now[s][1] == 0 for s in stages)

        wait_until(dropped, 5)
        assert demo.metric("omni_realtime_responses_cancelled_total") == cancelled + 1
    print(f"{when}: session ended {ended_s:.3f} s after the reset,"
          f" every stage clear {time.monotonic() - reset_at:.3f} s after")  # fmt: skip
    assert ended_s < 2.0, f"the session outlived its client by {ended_s:.1f} s"


async def test_a_close_from_a_client_that_stopped_reading_ends_the_session_at_once(
    demo: Deployment,
) -> None:
    """The client stops reading mid-answer, then closes: the server ends the session and
    aborts the request as soon as the close frame arrives (the client's own close waits
    for the server's reply behind the audio it did not read, up to its close timeout)."""
    cancelled = demo.metric("omni_realtime_responses_cancelled_total")
    before = demo.stage_aborts()
    conn = await demo.client().realtime.connect(model="omni").enter()
    await conn.conversation.item.create(item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": LONG_TEXT}]
    })  # fmt: skip
    await conn.response.create()
    heard = Heard()
    while "response.output_audio.delta" not in heard.kinds:
        take(heard, await asyncio.wait_for(conn.recv(), 10))
    client_port = conn._connection.transport.get_extra_info("sockname")[1]
    await wait_for(lambda: server_send_queue(demo.serve.port, client_port) > 32 * 1024, 20)
    closing = asyncio.ensure_future(conn.close())
    closed_at = time.monotonic()
    await wait_for(lambda: demo.metric("omni_realtime_sessions_open") == 0, 5)
    ended_s = time.monotonic() - closed_at

    def dropped() -> bool:
        now = demo.stage_aborts()
        return all(now[s][0] > before.get(s, (0, 0))[0] and now[s][1] == 0 for s in (0, 1, 2))

    await wait_for(dropped, 5)
    dropped_s = time.monotonic() - closed_at
    assert demo.metric("omni_realtime_responses_cancelled_total") == cancelled + 1
    await closing
    print(f"session ended {ended_s:.3f} s, every stage clear {dropped_s:.3f} s after the close;"
          f" the client's close took {time.monotonic() - closed_at:.3f} s")  # fmt: skip
    assert ended_s < 2.0


@pytest.fixture(scope="module")
def impatient(demo: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A front door to the same deployment that waits 1 s for a client to take an event."""
    args = ("--pipeline", str(OMNI), "--mode", "streaming", "--redis-url", demo.redis_url,
            "--namespace", demo.namespace)  # fmt: skip
    env = {"OMNI_API_KEYS": KEY, "OMNI_REALTIME_SEND_TIMEOUT_S": "1"}
    log = tmp_path_factory.mktemp("impatient") / "serve.log"
    with ServeProcess(log, *args, env=env) as serve:
        yield Deployment(demo.redis_url, demo.namespace, serve)


def test_a_client_that_takes_nothing_ends_its_session_and_its_request(
    impatient: Deployment,
) -> None:
    """Frozen, or gone without a reset: its socket takes no event for
    OMNI_REALTIME_SEND_TIMEOUT_S, well before the outbox's 8 MiB would fill, and the
    request it started is aborted at every stage rather than run for nobody."""
    before = impatient.stage_aborts()
    client = RawClient(impatient.serve.port, KEY, rcvbuf=4096)
    try:
        assert client.recv()["type"] == "session.created"
        client.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": LONG_TEXT}]}})  # fmt: skip
        client.send({"type": "response.create"})
        client.recv_until("response.created")
        # ~7 MB of echoes: more than the kernel's socket buffers take, so a send waits
        flood = {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "y" * 30_000}]}  # fmt: skip
        for _ in range(120):
            client.send({"type": "conversation.item.create", "item": flood})
        started = time.monotonic()
        wait_until(lambda: impatient.metric("omni_realtime_sessions_open") == 0, 20)
        ended_s = time.monotonic() - started

        def dropped() -> bool:
            now = impatient.stage_aborts()
            return all(now[s][0] > before.get(s, (0, 0))[0] and now[s][1] == 0 for s in (0, 1, 2))

        wait_until(dropped, 5)
    finally:
        client.close()
    print(f"session ended {ended_s:.3f} s after the client's last event")
    assert "took no event for 1 s" in impatient.serve.log()
