"""An idle worker's reading threads block for seconds, yet deliver at once and stop at once."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import fakeredis
import pytest
import redis

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.start import Observability
from omni_runtime.redis_io.backoff import RetrySettings
from omni_runtime.redis_io.clients import sync_client
from omni_runtime.redis_io.entries import entry_fields
from omni_runtime.redis_io.interrupt import IDLE_BLOCK_MS, OwnConnection
from omni_runtime.redis_io.streams import SyncGroupReader, ensure_group_sync
from omni_runtime.redis_io.write_ops import xadd_fields
from omni_runtime.settings import Settings
from omni_runtime.wire.messages import AbortMsg, StageInputMsg
from omni_runtime.wire.views import StageInputView
from omni_runtime.worker.actions import Input
from omni_runtime.worker.io_threads import (
    ControlThread,
    Handoff,
    InputThread,
    ReaderSettings,
    Slots,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

SETTINGS = Settings(redis_url="redis://unused")


def blocked(client: redis.Redis, own: OwnConnection | None) -> bool:
    """The server holds `own`'s connection in a blocking read."""
    assert own is not None and own._id is not None
    return any(c["id"] == str(own._id) and "b" in c["flags"] for c in client.client_list())


def input_thread(client: redis.Redis, stream: str) -> tuple[InputThread, Handoff[Input]]:
    ensure_group_sync(client, stream, keys.WORKERS_GROUP)
    stop = threading.Event()
    reader = SyncGroupReader(
        client, stream, keys.WORKERS_GROUP, "w1", StageInputView,
        max_bytes=SETTINGS.max_message_bytes, dead_letters=f"{stream}:dead", stop=stop,
    )  # fmt: skip
    got: Handoff[Input] = Handoff(threading.Event().set)
    thread = InputThread(
        reader, Slots(4), got.put,
        SETTINGS.part(ReaderSettings, retry=SETTINGS.part(RetrySettings)),
        stage_id=0, obs=Observability(), stop=stop,
    )  # fmt: skip
    return thread, got


def control_thread(
    client: redis.Redis, stream: str, deliver: Callable[[list[str]], None]
) -> ControlThread:
    reading = SETTINGS.part(ReaderSettings, retry=SETTINGS.part(RetrySettings))
    return ControlThread(client, stream, deliver, reading, Metrics())


def test_an_idle_input_read_blocks_long_delivers_at_once_and_a_stop_ends_it(
    redis_url: str,
) -> None:
    client = sync_client(redis_url)
    stream = f"idle-{uuid.uuid4().hex[:8]}:in"
    thread, got = input_thread(client, stream)
    thread.start()
    try:
        assert thread.own is not None and thread.own.block_ms(250) == IDLE_BLOCK_MS
        wait_until(lambda: blocked(client, thread.own))
        client.xadd(stream, xadd_fields(entry_fields(StageInputMsg(request_id="r1", data="x"))))
        delivered: list[Input] = []

        def arrived() -> bool:
            delivered.extend(got.take())
            return bool(delivered)

        wait_until(arrived)
        assert [i.msg.request_id for i in delivered] == ["r1"]
        wait_until(lambda: blocked(client, thread.own))  # again, in a read lasting seconds
    finally:
        t0 = time.monotonic()
        thread.request_stop()
        thread.join(IDLE_BLOCK_MS / 1000 * 2)
        stopped_s = time.monotonic() - t0
        client.close()
    assert not thread._thread.is_alive()
    assert stopped_s < IDLE_BLOCK_MS / 1000 / 2  # ended, not waited out


def test_a_stop_that_missed_the_read_is_ended_by_join(redis_url: str) -> None:
    client = sync_client(redis_url)
    stream = f"idle-{uuid.uuid4().hex[:8]}:ctl"
    thread = control_thread(client, stream, lambda _a: None)
    thread.start()
    wait_until(lambda: blocked(client, thread.own))
    thread._stop.set()  # as if the unblock had gone out just before the read began
    t0 = time.monotonic()
    thread.join(IDLE_BLOCK_MS / 1000 * 2)
    assert not thread._thread.is_alive()
    assert time.monotonic() - t0 < IDLE_BLOCK_MS / 1000 / 2
    client.close()


def test_an_abort_reaches_a_control_thread_blocked_long(redis_url: str) -> None:
    client = sync_client(redis_url)
    stream = f"idle-{uuid.uuid4().hex[:8]}:ctl"
    aborts: list[str] = []
    thread = control_thread(client, stream, aborts.extend)
    thread.start()
    try:
        assert thread.own is not None and thread.own.block_ms(250) == IDLE_BLOCK_MS
        wait_until(lambda: blocked(client, thread.own))
        client.xadd(stream, xadd_fields(entry_fields(AbortMsg(request_id="gone"))))
        wait_until(lambda: aborts == ["gone"])
    finally:
        thread.request_stop()
        thread.join(IDLE_BLOCK_MS / 1000 * 2)
        client.close()
    assert not thread._thread.is_alive()


def test_a_starting_control_thread_delivers_the_recent_aborts_first() -> None:
    """A request aborted while its worker was down must not run in the next one: the
    thread delivers what the stream holds from the age limit before its last abort on, in
    pages, before it starts (and so before the worker's input thread)."""
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    stream = "ctl"
    newest_ms = 10_000_000
    age_ms = int(keys.CONTROL_STREAM_AGE_S * 1000)

    def abort(request_id: str, ms: int) -> None:
        fields = xadd_fields(entry_fields(AbortMsg(request_id=request_id)))
        client.xadd(stream, fields, id=f"{ms}-0")

    abort("too-old", newest_ms - age_ms - 1)
    for i in range(5):
        abort(f"recent-{i}", newest_ms - age_ms + i)
    client.xadd(stream, {"junk": b"x"}, id=f"{newest_ms - 1}-0")
    abort("newest", newest_ms)
    reading = SETTINGS.part(ReaderSettings, retry=SETTINGS.part(RetrySettings), read_count=2)
    metrics = Metrics()
    aborts: list[str] = []
    thread = ControlThread(client, stream, aborts.extend, reading, metrics)
    thread.start()
    try:
        assert aborts == [f"recent-{i}" for i in range(5)] + ["newest"]  # before any read
        assert metrics.value("omni_malformed_entries_total", stream=stream) == 1
        abort("later", newest_ms + 1)
        wait_until(lambda: aborts[-1:] == ["later"])
        assert aborts.count("newest") == 1
    finally:
        thread.request_stop()
        thread.join(IDLE_BLOCK_MS / 1000 * 2)


def test_an_unblocked_read_resumes_on_a_new_connection_after_a_disconnect(redis_url: str) -> None:
    client = sync_client(redis_url)
    own = OwnConnection(client, "test")
    first = own._id
    assert first is not None
    assert own.client.connection is not None
    own.client.connection.disconnect()
    assert own.client.ping()  # reconnected: the id followed the new connection
    assert own._id is not None and own._id != first
    own.close()
    client.close()


def test_without_real_sockets_a_thread_keeps_short_reads() -> None:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    own = OwnConnection(client, "test")
    assert own.client is client and own.block_ms(250) == 250
    own.unblock()  # nothing to end: a no-op
    own.close()


def test_a_user_denied_client_commands_keeps_short_reads(redis_url: str) -> None:
    user, secret = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser(
        user, enabled=True, passwords=[f"+{secret}"], keys=["*"], commands=["+@all", "-client"]
    )
    try:
        client = sync_client(redis_url.replace("redis://", f"redis://{user}:{secret}@"))
        own = OwnConnection(client, "test")
        assert own.client is client and own.block_ms(250) == 250
        client.close()
    finally:
        admin.acl_deluser(user)
        admin.close()


def test_a_read_ends_before_the_socket_timeout_would_cut_it(redis_url: str) -> None:
    client = sync_client(redis_url, socket_timeout=2.0)
    own = OwnConnection(client, "test")
    assert own.block_ms(250) == 1000  # a second short of the 2 s socket timeout
    assert own.client.xread({f"idle-{uuid.uuid4().hex[:8]}": "0-0"}, block=own.block_ms(250)) == []
    own.close()
    client.close()
