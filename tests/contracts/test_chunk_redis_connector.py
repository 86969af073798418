"""What the Redis connector promises beyond the SPEC contract (SPEC §5), on fakeredis and on
a real redis-server: namespace prefix, TTL, retries with the Backoff given, errors by class."""

from __future__ import annotations

import functools
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import fakeredis
import pytest
import redis

from omni_runtime import ChunkAdapter, keys
from omni_runtime.chunks import RedisConnector
from omni_runtime.chunks.redis_packed import PackedPipe
from omni_runtime.errors import CodecError, ConfigError, TransportError
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.redis_io.conn import SmallFirstPacker
from tests.waiting import wait_until

REAL = pytest.param("redis-server", marks=pytest.mark.redis_server)
NOT_PICKLE_NOT_MSGPACK = b"\xc1\xc1 this is not msgpack \xc1"


@dataclass
class RedisVariant:
    """A raw client to inspect Redis, and a factory for connectors on the same server."""

    raw: redis.Redis
    make: Callable[..., RedisConnector]


@pytest.fixture(params=["fakeredis", REAL])
def redis_variant(request: pytest.FixtureRequest) -> Iterator[RedisVariant]:
    made: list[RedisConnector] = []
    if request.param == "fakeredis":
        server = fakeredis.FakeServer()
        raw: redis.Redis = fakeredis.FakeRedis(server=server)
        clients: list[redis.Redis] = [raw]

        def make(**kw: Any) -> RedisConnector:
            client = fakeredis.FakeRedis(server=server)
            clients.append(client)
            return RedisConnector(client, **kw)

    else:
        url = request.getfixturevalue("redis_url")
        raw = redis.Redis.from_url(url)
        clients = [raw]

        def make(**kw: Any) -> RedisConnector:
            conn = RedisConnector.from_url(url, **kw)
            made.append(conn)
            return conn

    yield RedisVariant(raw, make)
    for conn in made:
        conn.close()
    for client in clients:
        client.close()


@contextmanager
def refused_loopback_port() -> Iterator[int]:
    """A loopback port that is bound but not listening, so connecting to it is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def fail_commands(
    monkeypatch: pytest.MonkeyPatch, conn: RedisConnector, command: str, times: int
) -> list[int]:
    """Make the next `times` `command`s on the connector's client raise redis ConnectionError."""
    calls = [0]
    real: Callable[..., Any] = conn.client.execute_command

    def flaky(*args: Any, **options: Any) -> Any:
        if str(args[0]).upper() == command:
            calls[0] += 1
            if calls[0] <= times:
                raise redis.exceptions.ConnectionError(f"injected failure {calls[0]}")
        return real(*args, **options)

    real_pipeline: Callable[..., Any] = conn.client.pipeline

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute

        def execute(*e_args: Any, **e_kwargs: Any) -> Any:
            if any(str(c[0][0]).upper() == command for c in pipe.command_stack):
                calls[0] += 1
                if calls[0] <= times:
                    pipe.reset()
                    raise redis.exceptions.ConnectionError(f"injected failure {calls[0]}")
            return real_execute(*e_args, **e_kwargs)

        pipe.execute = execute
        return pipe

    real_packed = PackedPipe.execute

    def packed_execute(pipe: PackedPipe) -> list[Any]:  # the put's own packed round trip
        if any(str(c[0]).upper() == command for c in pipe.commands):
            calls[0] += 1
            if calls[0] <= times:
                raise redis.exceptions.ConnectionError(f"injected failure {calls[0]}")
        return real_packed(pipe)

    monkeypatch.setattr(PackedPipe, "execute", packed_execute)
    monkeypatch.setattr(conn.client, "execute_command", flaky)
    monkeypatch.setattr(conn.client, "pipeline", pipeline)
    return calls


# --- Redis specifics (fakeredis and real redis-server) ---------------------------------


def test_prefix_is_applied_inside_and_every_key_has_a_ttl(redis_variant: RedisVariant) -> None:
    conn = redis_variant.make(prefix="omni:test:", ttl_s=60)
    raw = redis_variant.raw
    conn.put("r1_0_0", {"data": "x", "finished": False})
    conn.put("r1_0_1", {"data": "y", "finished": False})
    conn.put("r1_0_2", {"data": "z", "finished": True})
    assert raw.exists("omni:test:{r1}_0_0") == 1  # prefixed, and tagged by request
    assert raw.exists("r1_0_0") == raw.exists("{r1}_0_0") == 0
    assert 0 < raw.ttl("omni:test:{r1}_0_0") <= 60
    assert conn.get("r1_0_0") == {"data": "x", "finished": False}
    assert conn.fetch(["r1_0_1"]) == [{"data": "y", "finished": False}]
    assert conn.discard(["r1_0_2", "r1_0_9"]) == 1
    assert raw.exists("omni:test:{r1}_0_0", "omni:test:{r1}_0_1", "omni:test:{r1}_0_2") == 0


def test_default_ttl_is_the_chunk_ttl(redis_variant: RedisVariant) -> None:
    conn = redis_variant.make()
    conn.put("r1_0_0", {"data": "x", "finished": False})
    assert keys.CHUNK_TTL_S - 5 <= redis_variant.raw.ttl("{r1}_0_0") <= keys.CHUNK_TTL_S


def test_put_retries_with_exponential_backoff_then_succeeds(
    redis_variant: RedisVariant, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = redis_variant.make(retry=Backoff(initial_s=0.001, max_s=1.0, max_attempts=4))
    calls = fail_commands(monkeypatch, conn, "SET", times=3)
    sleeps: list[float] = []
    monkeypatch.setattr("omni_runtime.chunks.redis.time.sleep", sleeps.append)
    conn.put("r1_0_0", {"data": "ok", "finished": True})
    assert calls[0] == 4
    assert sleeps == pytest.approx([0.001, 0.002, 0.004])
    assert conn.get("r1_0_0") == {"data": "ok", "finished": True}


def test_put_raises_transport_error_after_exhausting_retries(
    redis_variant: RedisVariant, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = redis_variant.make(retry=Backoff(initial_s=0.0, max_attempts=3))
    calls = fail_commands(monkeypatch, conn, "SET", times=3)
    with pytest.raises(TransportError, match="3 attempt") as info:
        conn.put("r1_0_0", {"data": "lost", "finished": False})
    assert isinstance(info.value.__cause__, redis.exceptions.ConnectionError)
    assert calls[0] == 3
    assert redis_variant.raw.exists("{r1}_0_0") == 0


def test_one_attempt_means_no_retry(
    redis_variant: RedisVariant, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = redis_variant.make(retry=Backoff(max_attempts=1))
    calls = fail_commands(monkeypatch, conn, "SET", times=1)
    with pytest.raises(TransportError):
        conn.put("r1_0_0", {"data": "lost", "finished": False})
    assert calls[0] == 1


def test_get_failure_raises_transport_error(
    redis_variant: RedisVariant, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = redis_variant.make()
    conn.put("r1_0_0", {"data": "kept", "finished": False})
    fail_commands(monkeypatch, conn, "GETDEL", times=1)
    with pytest.raises(TransportError) as info:
        conn.get("r1_0_0")
    assert isinstance(info.value.__cause__, redis.exceptions.RedisError)
    assert conn.get("r1_0_0") == {"data": "kept", "finished": False}


def test_get_of_a_malformed_value_raises_codec_error_and_counts_it(
    redis_variant: RedisVariant,
) -> None:
    conn = redis_variant.make(prefix="p:")
    redis_variant.raw.set("p:{bad}_0_0", NOT_PICKLE_NOT_MSGPACK)
    with pytest.raises(CodecError):
        conn.get("bad_0_0")
    assert conn.get("bad_0_0") is None  # consumed: a malformed value is not served twice


def test_invalid_settings_are_config_errors(redis_variant: RedisVariant) -> None:
    with pytest.raises(ConfigError, match="ttl_s"):
        redis_variant.make(ttl_s=0)


def test_a_decoding_client_is_rejected(fake_server: fakeredis.FakeServer) -> None:
    client = fakeredis.FakeRedis(server=fake_server, decode_responses=True)
    try:
        with pytest.raises(ConfigError, match="decode_responses"):
            RedisConnector(client)
    finally:
        client.close()


@pytest.mark.redis_server
def test_from_url_packs_small_commands_with_hiredis_and_big_values_in_python(
    redis_url: str,
) -> None:
    with RedisConnector.from_url(redis_url) as conn:
        pool = conn.client.connection_pool
        assert isinstance(pool.connection_kwargs["command_packer"], SmallFirstPacker)
        connection = pool.get_connection()
        try:
            assert isinstance(connection._command_packer, SmallFirstPacker)
        finally:
            pool.release(connection)
        conn.put("packed_0_0", {"data": memoryview(b"\x00" * 10_000), "finished": False})
        assert conn.get("packed_0_0") == {"data": b"\x00" * 10_000, "finished": False}
        big = bytes(range(256)) * 8192  # 2 MiB: past SMALL_ARG_BYTES, the Python packer's
        conn.put("packed_0_1", {"data": big, "finished": True})
        assert conn.get("packed_0_1") == {"data": big, "finished": True}


def test_unreachable_server_is_a_transport_error() -> None:
    with refused_loopback_port() as port:
        url = f"redis://127.0.0.1:{port}/0"
        with RedisConnector.from_url(url, retry=Backoff(0.0, max_attempts=2)) as conn:
            with pytest.raises(TransportError, match="2 attempt"):
                conn.put("r1_0_0", {"data": 1, "finished": False})
            with pytest.raises(TransportError):
                conn.get("r1_0_0")
            with pytest.raises(TransportError):
                conn.fetch(["r1_0_0"])


def test_a_chunk_that_came_with_its_wakeup_costs_the_receiver_no_read(redis_url: str) -> None:
    """One chunk at a time, each handed over before the next is saved: the receiver reads
    (MGET, GETDEL) only when it registers, never once per chunk; and every chunk's key is
    deleted once the last went."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    admin = redis.Redis.from_url(redis_url)
    sender = RedisConnector.from_url(redis_url, prefix=prefix)
    receiver = RedisConnector.from_url(redis_url, prefix=prefix)
    snd, rcv = ChunkAdapter(sender, stage_id=0), ChunkAdapter(receiver, stage_id=1)

    def reads() -> int:
        stats = admin.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("mget", "getdel"))

    try:
        rcv.load_async("q")
        wait_until(lambda: admin.exists(keys.chunk_route_key("q_0", prefix)) == 1)
        before = reads()
        got: list[Any] = []

        def handed_over(n: int) -> bool:
            got.extend(rcv.poll_ready().get("q", []))
            return len(got) > n

        for i in range(20):
            snd.save_async("q", i, is_final=i == 19)
            wait_until(functools.partial(handed_over, i))
        assert [c["data"] for c in got] == list(range(20))
        assert reads() - before <= 2  # at most one read-ahead after the first chunk
        wait_until(lambda: not list(admin.scan_iter(match=f"{prefix}{{q}}*")))
    finally:
        snd.stop()
        rcv.stop()
        sender.close()
        receiver.close()
        admin.close()


def test_a_wake_ends_a_blocked_wait_and_leaves_the_next_one_blocking(redis_url: str) -> None:
    """`wake` from another thread ends a long wait for puts at once; a wake's byte read or
    not by the wait it ended (a wake racing a wait's end leaves one unannounced) never
    makes a later wait return early."""
    receiver = RedisConnector.from_url(redis_url, prefix=f"t{uuid.uuid4().hex[:8]}:")
    out: list[dict[str, int]] = []
    try:
        receiver.wait_for_puts(0.01)  # the blocking read is in flight from here on
        waiting = threading.Thread(target=lambda: out.append(receiver.wait_for_puts(60)))
        waiting.start()
        receiver.wake()
        waiting.join(10)
        assert not waiting.is_alive() and out == [{}]
        pair = receiver._waiter._pair
        assert pair is not None
        pair[1].send(b"\0")  # the byte of a wake whose flag a wait's end already took
        for _ in range(2):  # the byte: a spurious wake at most, then read and gone
            receiver.wait_for_puts(0.2)
        t0 = time.monotonic()
        assert receiver.wait_for_puts(0.3) == {}
        assert time.monotonic() - t0 >= 0.25  # it waited: nothing left to wake it
    finally:
        receiver.close()


def test_a_put_after_the_server_dropped_the_held_connection_goes_through_at_once(
    redis_url: str,
) -> None:
    """Puts keep one connection between them; one the server closed meanwhile is replaced
    within the same put, not by the retry policy (here: none)."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    admin = redis.Redis.from_url(redis_url)
    conn = RedisConnector.from_url(redis_url, prefix=prefix, retry=Backoff(max_attempts=1))
    try:
        conn.put("r1_0_0", {"data": 0, "finished": False})
        me = admin.client_id()
        others = [c["id"] for c in admin.client_list() if int(c["id"]) != me]
        for client_id in others:
            admin.client_kill_filter(_id=client_id)
        wait_until(lambda: all(c["id"] not in others for c in admin.client_list()))
        conn.put("r1_0_1", {"data": 1, "finished": True})
        assert conn.get("r1_0_1") == {"data": 1, "finished": True}
    finally:
        conn.close()
        admin.close()


def test_puts_from_several_threads_at_once_all_land(redis_url: str) -> None:
    """One thread holds the put connection at a time; the others take pooled ones. Batches
    of different sizes (MULTI/EXEC: different reply counts) and values too big to go out in
    one write would tangle on a shared connection."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    conn = RedisConnector.from_url(redis_url, prefix=prefix)
    errors: list[BaseException] = []
    filler = "x" * 40_000

    def put_many(n: int) -> None:
        try:
            for first in range(0, 60, n + 1):
                ids = range(first, min(first + n + 1, 60))
                conn.put_batch(
                    [
                        (f"w{n}_0_{i}", {"data": [n, i, filler], "finished": False}, False)
                        for i in ids
                    ]
                )
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=put_many, args=(n,)) for n in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        for n in range(4):
            got = conn.fetch([f"w{n}_0_{i}" for i in range(60)])
            assert got == [{"data": [n, i, filler], "finished": False} for i in range(60)]
    finally:
        conn.close()
