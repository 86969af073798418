"""Handlers that name what they catch catch what really arrives there.

Each was a broad `except` that kept a loop or a thread alive; narrowed, an exception it
does not name would now end that loop. So each test makes the real failure happen (a
corrupted or hostile entry, Redis gone, a cluster's own error, a state that cannot be
written) and shows it caught, and the loop, thread or batch going on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import time
from typing import Any

import fakeredis
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from omni_runtime import cli, keys
from omni_runtime.core.types import ReqState
from omni_runtime.errors import CodecError, TransportError
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.redis_stats import parse_heartbeat
from omni_runtime.observe.start import Observability
from omni_runtime.observe.tracing import RedisTracer
from omni_runtime.orchestrator.request_store import RequestStore
from omni_runtime.redis_io.entries import parse_entries, parse_entry
from omni_runtime.redis_io.write_ops import HashPut
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import codec
from omni_runtime.wire.messages import (
    AbortMsg,
    DurableRequest,
    OrchOutputMsg,
    RequestMsg,
    StageInputMsg,
    StageOutputMsg,
)
from omni_runtime.wire.outgoing import DurableRequestOut
from tests.hostile import KINDS, any_docs, raw

pytestmark = pytest.mark.timeout(60)

MODEL: dict[str, type[BaseModel]] = {
    "request": RequestMsg,
    "abort": AbortMsg,
    "stage_input": StageInputMsg,
    "stage_output": StageOutputMsg,
    "orch_output": OrchOutputMsg,
    "request_state": DurableRequest,
}
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FIELD = keys.PAYLOAD_FIELD.encode()


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY
@given(data=st.data())
def test_any_entry_however_hostile_or_corrupted_is_refused_only_as_a_codec_error(
    kind: str, data: st.DataObject
) -> None:
    """Stream readers dead-letter a `CodecError` and go on; the worker's control thread
    skips one: nothing else may come out of reading an entry, or codec's `decode`/`check`."""
    wire = bytearray(raw(data.draw(any_docs(kind))))
    for at, byte in data.draw(st.lists(st.tuples(st.integers(0), st.integers(0, 255)), max_size=3)):
        wire[at % len(wire)] = byte
    for parse in (parse_entry, parse_entries):
        with contextlib.suppress(CodecError):
            parse({FIELD: bytes(wire)}, MODEL[kind], 1 << 20)
    for read in (codec.decode, codec.check):
        with contextlib.suppress(CodecError):
            read(bytes(wire))


def test_a_heartbeat_document_that_is_not_msgpack_reads_as_a_plain_value() -> None:
    for value in (b"worker-7", b"\x81\x81\xa1a\x01\x02", b"\xc1", b"\x92\x01"):
        assert parse_heartbeat(value) == {"value": value.decode(errors="replace")}, value


def _fake_args(func: Any) -> argparse.Namespace:
    return argparse.Namespace(
        command="status", func=func, verbose=False, log_level="WARNING", log_format="text"
    )


def test_the_command_line_tells_a_redis_error_in_one_line_and_raises_anything_else(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(_args: argparse.Namespace) -> int:
        _nobody_listening().ping()
        return 0

    def broken(_args: argparse.Namespace) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "configure_logging", lambda *_a: None)
    monkeypatch.setattr(cli, "parse_args", lambda _argv: _fake_args(refused))
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omni-runtime: error: Redis: ") and err.count("\n") == 1, err
    monkeypatch.setattr(cli, "parse_args", lambda _argv: _fake_args(broken))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main([])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nobody_listening() -> redis.Redis:
    """A client of a port nobody listens on, refused at once (redis-py's default retries
    back off for seconds before they say so)."""
    return redis.Redis(port=_free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))


async def test_a_cluster_error_gives_up_one_batch_and_the_writer_goes_on(
    fake_server: fakeredis.FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`RedisClusterException` is no `RedisError`, so the writer's own retries do not see it."""
    client = fakeredis.FakeAsyncRedis(server=fake_server)
    pool, failures = client.connection_pool, [RedisClusterException("no node for the slot")]
    connect: Any = pool.get_connection

    async def failing_once(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return await connect(*args, **kwargs)

    monkeypatch.setattr(pool, "get_connection", failing_once)
    told: list[tuple[list[str], TransportError]] = []
    writer = StreamWriter(client, 100, on_failed=lambda rids, e: told.append((rids, e)))
    task = asyncio.create_task(writer.run())
    try:
        writer.xadd("s", {"m": b"1"}, owner="r1")
        assert await writer.written() is False
        assert [rids for rids, _e in told] == [["r1"]] and "RedisClusterException" in str(
            told[0][1]
        )
        writer.xadd("s", {"m": b"2"}, owner="r2")
        assert await writer.written() is True
        assert await client.xlen("s") == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


def test_a_tracer_whose_redis_is_gone_drops_its_stamps_and_keeps_writing() -> None:
    tracer = RedisTracer(_nobody_listening(), keys.Names("t")).start()
    try:
        tracer.stamp("request_read", "r1")
        assert tracer.flush(10)
        assert tracer.dropped == 1 and tracer._thread.is_alive()
        tracer.stamp("request_read", "r2")
        assert tracer.flush(10)
        assert tracer.dropped == 2
    finally:
        tracer.close()


def _doc(rid: str, state: ReqState, deadline_at: float | None) -> DurableRequestOut:
    return DurableRequestOut(
        request_id=rid,
        client_id="c1",
        prompt=state.prompt,
        deadline_at=deadline_at,
        submitted=sorted(state.submitted),
        finished=sorted(state.finished),
    )


def test_a_state_that_cannot_be_written_fails_its_request_alone() -> None:
    """Its deadline out of range (`ValueError`), its prompt too deep to encode
    (`CodecError`), or `describe` raising: that request is told, the others' are written."""
    now = time.time()
    deep: Any = 0
    for _ in range(codec.MAX_DEPTH + 1):
        deep = [deep]

    def describe(rid: str, state: ReqState) -> DurableRequestOut:
        if rid == "broken":
            raise KeyError("a bug in describe")
        return _doc(rid, state, float("inf") if rid == "far" else now + 10)

    failed: list[tuple[str, type[Exception]]] = []
    store = RequestStore(
        StreamWriter(fakeredis.FakeAsyncRedis(), 100),
        keys.Names("t"),
        0,
        describe,
        failed=lambda rid, e: failed.append((rid, type(e))),
    )
    for rid, prompt in (("ok", "p"), ("far", "p"), ("deep", deep), ("broken", "p"), ("ok2", "q")):
        store.changed(rid, ReqState(prompt=prompt, submitted={0}))
    ops = store.ops()
    assert sorted(failed) == [("broken", KeyError), ("deep", CodecError), ("far", ValueError)]
    put = ops[0]
    assert isinstance(put, HashPut) and set(put.fields) == {"ok", "ok2"}


def test_observability_that_cannot_stop_one_piece_stops_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stopped: list[str] = []

    def disk_gone() -> None:
        raise OSError(28, "No space left on device")

    obs = Observability(Metrics(), None)
    obs._stops += [lambda: stopped.append("first"), disk_gone, lambda: stopped.append("last")]
    with caplog.at_level(logging.WARNING):
        obs.close()
    assert stopped == ["last", "first"]
    assert "No space left on device" in caplog.text
