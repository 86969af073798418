"""The worker's output: with no write in flight, the loop sends a batch itself (`publish`)
and the output thread only reads the replies; a batch whose replies fail is written again
by the thread, unless the replica was deposed meanwhile (real redis-server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io.backoff import Backoff
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageOutputMsg
from omni_runtime.worker.actions import Outgoing
from omni_runtime.worker.fence import StallFence
from omni_runtime.worker.output import OutputThread
from omni_runtime.worker.output_batch import OutputBatch
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)

OUT, IN = "out", "in"


def final(rid: str) -> Outgoing:
    msg = StageOutputMsg(request_id=rid, data=rid, finished=True, seq=0)
    return Outgoing(rid, 0, codec.encode_model(msg), True, False, None)


class Writer:
    """An output thread on the real Redis, warmed up (its connection held), whose every
    turn (reading a loop-sent batch's replies, or writing one) the test can hold back."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.metrics = Metrics()
        self.fence = StallFence(ttl_s=60)
        self.thread = OutputThread(
            self.client,
            OUT,
            IN,
            maxlen=1000,
            backoff=lambda: Backoff(0.01, 0.01, 3),
            on_lost=lambda *_: None,
            metrics=self.metrics,
            fence=self.fence,
        )
        self.gate = threading.Event()
        self.gate.set()
        finish, write = self.thread._finish, self.thread._write

        def gated_finish(batch: OutputBatch) -> None:
            self.gate.wait(10)
            finish(batch)

        def gated_write(batch: OutputBatch) -> None:
            self.gate.wait(10)
            write(batch)

        self.thread._finish = gated_finish  # type: ignore[method-assign]
        self.thread._write = gated_write  # type: ignore[method-assign]
        self.thread.start()
        self.thread.publish([final("warm")], [])
        wait_until(self.thread.idle, 5)

    def close(self) -> None:
        self.gate.set()
        self.thread.request_stop()
        self.thread.join(5)
        self.client.close()


@pytest.fixture
def writer(redis_url: str) -> Iterator[Writer]:
    w = Writer(redis_url)
    try:
        yield w
    finally:
        w.close()


def rids(client: redis.Redis) -> list[str]:
    entries: Any = client.xrange(OUT)
    return [codec.decode(f[keys.PAYLOAD_FIELD.encode()])["request_id"] for _i, f in entries]


def test_the_loop_sends_a_batch_itself_and_the_thread_only_reads_its_replies(
    writer: Writer,
) -> None:
    writer.gate.clear()  # the output thread cannot touch the batch from here on
    writer.thread.publish([final("a")], [])
    wait_until(lambda: rids(writer.client) == ["warm", "a"], 5)
    assert not writer.thread.idle()  # its replies are not read yet
    writer.gate.set()
    wait_until(writer.thread.idle, 5)
    assert rids(writer.client) == ["warm", "a"]  # once


def test_a_batch_whose_replies_fail_is_written_again_by_the_thread(
    writer: Writer, redis_url: str
) -> None:
    probe = redis.Redis.from_url(redis_url)
    writer.gate.clear()
    probe.client_pause(10_000, all=False)  # writes wait in Redis, unrun
    try:
        writer.thread.publish([final("a")], [])
        wait_until(lambda: not writer.thread.idle(), 5)
        probe.client_kill_filter(_type="normal", skipme=True)  # the batch dies unrun
    finally:
        probe.client_unpause()
    writer.gate.set()
    wait_until(writer.thread.idle, 10)
    assert rids(probe) == ["warm", "a"]
    assert writer.metrics.value("omni_retries_total", stream=OUT) >= 1
    probe.close()


def test_a_batch_whose_replies_fail_is_not_written_again_once_deposed(
    writer: Writer, redis_url: str
) -> None:
    """Sent from the loop, then the worker stalls past its heartbeat TTL: another replica
    may run those inputs now, so the failed batch must not be written late."""
    probe = redis.Redis.from_url(redis_url)
    writer.gate.clear()
    probe.client_pause(10_000, all=False)
    try:
        writer.thread.publish([final("a")], [])
        wait_until(lambda: not writer.thread.idle(), 5)
        probe.client_kill_filter(_type="normal", skipme=True)
        assert writer.fence.renew(time.monotonic() + 3600)  # the fence shuts: ownership unsure
    finally:
        probe.client_unpause()
    writer.gate.set()
    writer.thread.request_stop()  # stopping with the fence shut: the batch is dropped
    writer.thread.join(5)
    assert rids(probe) == ["warm"]
    assert writer.metrics.value("omni_fenced_outputs_total") == 1
    probe.close()


class FailsOnce:
    """Stands in for a method: raises `error` on the first call, then calls the real one."""

    def __init__(self, real: Any, error: Exception) -> None:
        self.real, self.error, self.calls = real, error, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return self.real(*args)


@pytest.mark.parametrize("where", ["send", "routing"])
def test_a_batch_the_loop_could_not_send_is_written_by_the_thread(
    writer: Writer, where: str
) -> None:
    """Whatever goes wrong on the loop's side, the writer's turn is handed back: the
    batch is written once, and the outputs after it flow as before."""
    thread = writer.thread
    if where == "send":
        assert thread._held is not None
        thread._held.send = FailsOnce(thread._held.send, RuntimeError("boom"))  # type: ignore[method-assign,assignment]
    else:
        thread._batch = FailsOnce(thread._batch, RuntimeError("boom"))  # type: ignore[method-assign,assignment]
    thread.publish([final("a")], [])
    wait_until(lambda: rids(writer.client) == ["warm", "a"], 5)
    wait_until(thread.idle, 5)
    thread.publish([final("b")], [])
    wait_until(lambda: rids(writer.client) == ["warm", "a", "b"], 5)
