"""`/v1/realtime` with the official `openai` client, on the synthetic demo (workers/omni.yaml
in streaming mode), against real processes: turns, barge-in, limits, bad events, a client
that stops reading (disconnects: test_realtime_disconnects.py)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import websockets
from websockets.typing import Origin

from tests.e2e.raw_realtime import RawClient
from tests.e2e.realtime_client import (
    CHUNK_BYTES,
    Heard,
    recv,
    send_speech,
    silence,
    speech,
    take,
    until_done,
    user_text,
)
from tests.e2e.realtime_deployment import (
    KEY,
    LONG_TEXT,
    Deployment,
    front_door,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]


def expected_audio_s(text: str) -> float:
    """The demo's audio for `text`: 20 ms per letter of each token."""
    return sum(0.020 * len(t) for t in re.findall(r"\w+|[^\w\s]", text))


async def test_a_text_turn_streams_text_and_24khz_audio(demo: Deployment) -> None:
    async with demo.client().realtime.connect(model="omni") as conn:
        created = await recv(conn)
        assert created.type == "session.created"
        await conn.session.update(session={
            "type": "realtime", "instructions": "Answer briefly.",
            "output_modalities": ["text", "audio"],
            "audio": {"input": {"turn_detection": None}, "output": {"voice": "alloy"}},
        })  # fmt: skip
        updated: Any = await recv(conn)
        assert updated.type == "session.updated"
        assert updated.session.instructions == "Answer briefly."
        assert updated.session.audio.output.voice == "alloy"
        await conn.conversation.item.create(item=user_text("Hello, realtime world!"))
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


async def test_an_out_of_band_response_joins_no_conversation(demo: Deployment) -> None:
    """`response.conversation: "none"` (what agents use to ask a side question): answered
    as any response, but no `conversation.item.*` event says its item, and the next
    response's items do; a context of its own (`response.input`: items given whole, or the
    conversation's by reference) is read instead of the conversation."""
    aside: Any = user_text("Something else")
    async with demo.client().realtime.connect(model="omni") as conn:
        assert (await recv(conn)).type == "session.created"
        await conn.conversation.item.create(item=user_text("Hello there"))
        first: Any = await recv(conn)
        assert first.type == "conversation.item.added"
        assert (await recv(conn)).type == "conversation.item.done"
        await conn.response.create(response={"conversation": "none", "output_modalities": ["text"]})
        apart = await until_done(conn)
        await conn.response.create(response={
            "conversation": "none", "output_modalities": ["text"], "input": [aside]})  # fmt: skip
        own = await until_done(conn)
        reference: Any = [aside, {"type": "item_reference", "id": first.item.id}]
        await conn.response.create(response={
            "conversation": "none", "output_modalities": ["text"], "input": reference})  # fmt: skip
        referred = await until_done(conn)
        unknown: Any = [{"type": "item_reference", "id": "item_nope"}]
        await conn.response.create(response={"input": unknown})
        refused = await until_error(conn)
        await conn.response.create(response={"output_modalities": ["text"]})
        joined = await until_done(conn)
    assert apart.errors == [] and apart.status == "completed" and apart.text == "Hello there"
    assert "response.output_item.done" in apart.kinds
    assert not [k for k in apart.kinds if k.startswith("conversation.item.")], apart.kinds
    assert own.errors == [] and own.text == "Something else"  # the demo says the last turn
    assert referred.errors == [] and referred.text == "Hello there"
    assert refused.param == "response.input.0.id" and refused.code == "item_not_found"
    assert joined.errors == [] and joined.text == "Hello there"
    assert joined.kinds.count("conversation.item.added") == 1, joined.kinds
    assert joined.kinds.count("conversation.item.done") == 1, joined.kinds


async def until_error(conn: Any) -> Any:
    """The next `error` event's error (within the turn's time)."""
    async with asyncio.timeout(30):
        while (ev := await recv(conn)).type != "error":
            pass
    return ev.error


async def test_a_wrong_key_gets_an_error_and_the_socket_closes(demo: Deployment) -> None:
    client = openai.AsyncOpenAI(base_url=f"{demo.serve.url}/v1", api_key="wrong-key-123")
    with pytest.raises(Exception) as raised:
        async with client.realtime.connect(model="omni") as conn:
            ev = await recv(conn)
            assert ev.type == "error" and ev.error.code == "invalid_api_key"
            await recv(conn)  # the server closes
    assert isinstance(raised.value, websockets.ConnectionClosed | websockets.InvalidStatus)


async def test_a_web_page_of_another_origin_may_not_open_a_session(demo: Deployment) -> None:
    """Browsers make no CORS check on a WebSocket: the server refuses another site's page
    (403) even with a valid key, and takes its own page's (the playground)."""
    url = demo.serve.url.replace("http://", "ws://", 1) + "/v1/realtime?model=omni"
    key = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(
            url, origin=Origin("http://evil.test"), additional_headers=key
        ):
            pass
    assert refused.value.response.status_code == 403
    assert b"OMNI_CORS_ORIGINS" in refused.value.response.body
    own = Origin(demo.serve.url)
    async with websockets.connect(url, origin=own, additional_headers=key) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"


@pytest.fixture(scope="module")
def capped(demo: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A front door that holds two Realtime sessions at most."""
    yield from front_door(demo, tmp_path_factory, "capped", {"OMNI_REALTIME_MAX_SESSIONS": "2"})


async def test_a_session_past_the_cap_is_refused_until_one_closes(capped: Deployment) -> None:
    """Each session holds memory (its audio, its queued events) whether it talks or not:
    past `OMNI_REALTIME_MAX_SESSIONS` a handshake gets 429, and a place freed is taken."""
    url = capped.serve.url.replace("http://", "ws://", 1) + "/v1/realtime?model=omni"
    key = {"Authorization": f"Bearer {KEY}"}
    async with (
        websockets.connect(url, additional_headers=key) as first,
        websockets.connect(url, additional_headers=key) as second,
    ):
        for open_one in (first, second):
            assert json.loads(await open_one.recv())["type"] == "session.created"
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url, additional_headers=key):
                pass
        assert refused.value.response.status_code == 429
        assert b"too_many_sessions" in refused.value.response.body

    # once the server has seen the two close, it takes a new one
    def none_open() -> bool:
        return capped.metric("omni_realtime_sessions_open") == 0

    await asyncio.to_thread(wait_until, none_open, 10)
    async with websockets.connect(url, additional_headers=key) as again:
        assert json.loads(await again.recv())["type"] == "session.created"


async def test_barge_in_cancels_the_response_and_every_stage_drops_it(demo: Deployment) -> None:
    words = speech("Stop, please wait a moment.")
    async with demo.client().realtime.connect(model="omni") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "create_response": False}}}})  # fmt: skip
        await conn.conversation.item.create(item=user_text(LONG_TEXT))
        before = demo.stage_counts()
        await conn.response.create()
        heard = Heard()
        while "response.output_audio.delta" not in heard.kinds:
            take(heard, await asyncio.wait_for(recv(conn), 10))
        await send_speech(conn, silence(200) + words, CHUNK_BYTES)
        spoke_at = time.monotonic()
        heard = await until_done(conn, heard)
        assert heard.status == "cancelled", heard.kinds
        assert heard.done.response.status_details.reason == "turn_detected"
        assert "input_audio_buffer.speech_started" in heard.kinds
        assert len(heard.audio) < expected_audio_s(LONG_TEXT) * 24_000  # not all of it played

        # every stage was running it, and every stage dropped it
        wait_until(lambda: demo.dropped_since(before), 10, demo.explain_stages)
        print(f"dropped by every stage within {time.monotonic() - spoke_at:.3f} s of the speech")
        # the next turn starts at once and completes
        await conn.conversation.item.create(item=user_text("Go on."))
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
        assert (await recv(conn)).type == "session.created"
        ws = conn._connection  # raw frames: the client's own types would refuse these
        errors: list[Any] = []
        for i in range(1000):
            await ws.send(bad[i % len(bad)])
        async with asyncio.timeout(30):
            while len(errors) < 1000:
                ev = await recv(conn)
                assert ev.type == "error", ev.type
                errors.append(ev.error)
        codes = {e.code for e in errors}
        assert codes == {"invalid_json", "unknown_event_type", "invalid_value"}, codes
        await ws.send("x" * (64 * 1024 + 1))  # over OMNI_REALTIME_MAX_EVENT_BYTES
        too_large: Any = await recv(conn)
        assert too_large.error.code == "event_too_large"
        tool: Any = {"type": "function", "name": "clock", "parameters": {"type": "object"}}
        await conn.session.update(session={"type": "realtime", "instructions": "Be loud.",
                                           "tools": [tool]})  # fmt: skip
        refused: Any = await recv(conn)  # the demo's pipeline calls no tools
        assert (refused.error.code, refused.error.param) == (
            "unsupported_parameter",
            "session.tools",
        )
        await conn.session.update(session={"type": "realtime", "tool_choice": "none"})
        updated: Any = await recv(conn)
        assert updated.session.instructions == "" and updated.session.tools == []  # none applied
        await conn.conversation.item.create(item=user_text("Still here?"))
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
    yield from front_door(demo, tmp_path_factory, "tight", {
        "OMNI_REALTIME_MAX_BUFFER_S": "0.5",
        "OMNI_REALTIME_IDLE_TIMEOUT_S": "1",
        "OMNI_REALTIME_MAX_SESSION_S": "3",
        "OMNI_REALTIME_MAX_SEND_BYTES": str(64 * 1024),
    })  # fmt: skip


async def test_the_input_buffer_is_bounded(tight: Deployment) -> None:
    async with tight.client().realtime.connect(model="omni") as conn:
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        )
        await send_speech(conn, silence(400))
        await send_speech(conn, silence(200))  # 0.6 s > OMNI_REALTIME_MAX_BUFFER_S
        kinds: list[Any] = [await recv(conn) for _ in range(3)]
        assert [e.type for e in kinds] == ["session.created", "session.updated", "error"]
        assert kinds[2].error.code == "input_audio_buffer_full"
        await conn.input_audio_buffer.commit()  # the 0.4 s taken is still there
        committed: Any = await recv(conn)
        assert committed.type == "input_audio_buffer.committed"


async def test_idle_and_long_sessions_end(tight: Deployment) -> None:
    for busy in (False, True):
        started = time.monotonic()  # the server's clocks start after this
        async with tight.client().realtime.connect(model="omni") as conn:
            assert (await recv(conn)).type == "session.created"
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
                            ev: Any = await asyncio.wait_for(recv(conn), 0.3)
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
    create = json.dumps({"type": "conversation.item.create", "item": user_text("y" * 30_000)})

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


async def test_items_are_put_read_deleted_and_an_answer_truncated(demo: Deployment) -> None:
    """The client's own item calls: an item put first (`root`), read back, deleted; an
    answer truncated while it plays (as OpenAI's clients do when the user interrupts):
    its response is cancelled, its audio ends where the user stopped hearing it and its
    transcript is gone; a truncation past the audio sent is an error."""
    async with demo.client().realtime.connect(model="omni") as conn:
        assert (await recv(conn)).type == "session.created"
        await conn.session.update(session={
            "type": "realtime", "audio": {"input": {"turn_detection": None}}})  # fmt: skip
        assert (await recv(conn)).type == "session.updated"
        await conn.conversation.item.create(item=user_text(LONG_TEXT))
        asked: Any = await recv(conn)
        assert (await recv(conn)).type == "conversation.item.done"
        await conn.conversation.item.create(previous_item_id="root", item=user_text("Aside"))
        aside: Any = await recv(conn)
        assert aside.type == "conversation.item.added" and aside.previous_item_id is None
        assert (await recv(conn)).type == "conversation.item.done"
        await conn.conversation.item.retrieve(item_id=asked.item.id)
        got: Any = await recv(conn)
        assert got.type == "conversation.item.retrieved", got
        assert got.item.content[0].text == LONG_TEXT
        await conn.conversation.item.delete(item_id=aside.item.id)
        deleted: Any = await recv(conn)
        assert (deleted.type, deleted.item_id) == ("conversation.item.deleted", aside.item.id)

        await conn.response.create()
        heard, item_id = Heard(), None
        while item_id is None:
            ev: Any = await asyncio.wait_for(recv(conn), 10)
            take(heard, ev)
            item_id = ev.item_id if ev.type == "response.output_audio.delta" else None
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=10)
        heard = await until_done(conn, heard)
        truncated: Any = await asyncio.wait_for(recv(conn), 10)
        await conn.conversation.item.truncate(
            item_id=item_id, content_index=0, audio_end_ms=3_600_000
        )
        past: Any = await until_error(conn)
        await conn.conversation.item.retrieve(item_id=item_id)
        after: Any = await recv(conn)
    assert heard.status == "cancelled", heard.kinds
    assert heard.done.response.status_details.reason == "client_cancelled"
    assert len(heard.transcript) > 0  # words had come before the truncation
    assert (truncated.type, truncated.item_id, truncated.audio_end_ms) == (
        "conversation.item.truncated", item_id, 10
    )  # fmt: skip
    assert past.param == "audio_end_ms" and "past the end" in past.message
    assert after.item.content[0].transcript == "" and after.item.status == "incomplete"


async def test_an_answer_heard_in_part_keeps_the_words_heard(demo: Deployment) -> None:
    """An answer made whole, then truncated where the user stopped listening: it keeps the
    words said within the audio played (the demo speaks 20 ms per letter)."""
    async with demo.client().realtime.connect(model="omni") as conn:
        assert (await recv(conn)).type == "session.created"
        await conn.conversation.item.create(item=user_text("Hello, realtime world!"))
        await conn.response.create()
        heard = await until_done(conn)
        item_id = heard.done.response.output[0].id
        played_ms = round(expected_audio_s("Hello, realtime world!") * 1000 / 2)
        await conn.conversation.item.truncate(
            item_id=item_id, content_index=0, audio_end_ms=played_ms
        )
        truncated: Any = await recv(conn)
        await conn.conversation.item.retrieve(item_id=item_id)
        after: Any = await recv(conn)
    assert heard.status == "completed" and heard.transcript == "Hello , realtime world !"
    assert (truncated.type, truncated.audio_end_ms) == ("conversation.item.truncated", 200)
    # half its audio, half its 24 letters: "Hello ," ends at the 7th, "realtime" at the 16th
    assert after.item.content[0].transcript == "Hello ,"
