"""Chunk hand-off between two processes: `send KIND` / `recv KIND` (see `handoff.py`).

Kinds: `adapter` (ChunkAdapter over RedisConnector, as in a worker: `save_async` ->
the receiver's `on_ready` wakes a scheduler thread that calls `poll_ready`),
`raw_blpop` (RPUSH of the payload -> BLPOP), `raw_set_blpop_get` (SET + RPUSH of
the key -> BLPOP -> GET: the adapter's own round trips, with no threads between) and
`raw_threads` (RPUSH -> BLPOP with SPEC §4's two thread hand-offs and nothing else: the
caller wakes a sending thread through a Condition, the BLPOP thread wakes the consumer
through an Event).
Chunks carry a CLOCK_MONOTONIC stamp, read once the payload is decoded (every kind's);
the receiver prints `{"lat_ns", "missing"}`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from benchmarks.roles import emit
from omni_runtime import ChunkAdapter
from omni_runtime.chunks import RedisConnector
from omni_runtime.redis_io.clients import probe
from omni_runtime.wire import codec

GAP_MS = (2.0, 4.0)
CODES = [17, 404, 1000, 3, 512, 77, 901]
"""A talker-sized chunk: a token's worth of codec codes."""


def send(kind: str, url: str, prefix: str, rid: str, total: int) -> None:
    """`total` stamped chunks, U(2, 4) ms apart; then wait for EOF on stdin before stopping."""
    rng = random.Random(rid)
    conn = (
        RedisConnector.from_url(url, prefix=prefix, cluster=probe(url))
        if kind == "adapter"
        else None
    )
    adapter = ChunkAdapter(conn, stage_id=0) if conn is not None else None
    client = redis.Redis.from_url(url)
    client.ping()
    relay = ThreadRelay(lambda p: client.rpush(f"{prefix}list:{rid}", codec.encode(p)))
    for seq in range(total):
        payload = {"t": time.monotonic_ns(), "seq": seq, "codes": CODES}
        if adapter is not None:
            adapter.save_async(rid, payload, seq == total - 1)
        elif kind == "raw_threads":
            relay.put(payload)
        elif kind == "raw_blpop":
            client.rpush(f"{prefix}list:{rid}", codec.encode(payload))
        else:
            with client.pipeline(transaction=False) as pipe:
                pipe.set(f"{prefix}chunk:{rid}:{seq}", codec.encode(payload), ex=300)
                pipe.rpush(f"{prefix}list:{rid}", f"{prefix}chunk:{rid}:{seq}")
                pipe.execute()
        time.sleep(rng.uniform(*GAP_MS) / 1e3)
    emit({"sent": total})
    relay.stop()
    sys.stdin.read()  # the coordinator closes it once the receiver has everything
    if adapter is not None and conn is not None:
        adapter.stop()
        conn.close()
    client.close()


class ThreadRelay:
    """The sender's half of `raw_threads`: a FIFO and a thread woken through a Condition."""

    def __init__(self, write: Callable[[Any], Any]) -> None:
        self.write = write
        self._cv = threading.Condition()
        self._items: list[Any] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._items or self._stop):
                    self._cv.wait()
                items, self._items = self._items, []
                if not items:
                    return
            for item in items:
                self.write(item)


def recv_relayed(
    url: str, key: str, more: Callable[[], bool], record: Callable[[dict[str, Any], int], None]
) -> None:
    """The receiver's half of `raw_threads`: a BLPOP thread hands each payload to this one
    (the scheduler) through an Event."""
    ready, lock, got = threading.Event(), threading.Lock(), []
    stop = threading.Event()

    def pop() -> None:
        client = redis.Redis.from_url(url)
        while not stop.is_set():
            popped: Any = client.blpop([key], timeout=0.2)
            if popped is not None:
                with lock:
                    got.append(popped[1])
                ready.set()
        client.close()

    thread = threading.Thread(target=pop, daemon=True)
    thread.start()
    emit({"ready": True, "pid": os.getpid()})
    while more():
        ready.wait(0.1)
        ready.clear()
        with lock:
            taken = got[:]
            got.clear()
        payloads = [codec.decode(raw) for raw in taken]  # usable, as the other kinds' are
        now = time.monotonic_ns()
        for payload in payloads:
            record(payload, now)
    stop.set()
    thread.join(10)


def recv(kind: str, url: str, prefix: str, rid: str, total: int, warmup: int) -> None:
    deadline = time.monotonic() + total * GAP_MS[1] / 1e3 * 3 + 20
    lat: list[int] = []
    seen = 0

    def record(payload: dict[str, Any], now: int) -> None:
        nonlocal seen
        seen += 1
        if payload["seq"] >= warmup:
            lat.append(now - payload["t"])

    if kind == "adapter":
        conn = RedisConnector.from_url(url, prefix=prefix, cluster=probe(url))
        ready = threading.Event()
        adapter = ChunkAdapter(conn, stage_id=1, on_ready=ready.set)
        adapter.load_async(rid)
        time.sleep(0.2)  # listening before the first chunk is put
        emit({"ready": True, "pid": os.getpid()})
        while seen < total and time.monotonic() < deadline:  # the stage's scheduler thread
            ready.wait(0.1)
            ready.clear()
            got = adapter.poll_ready().get(rid, [])
            now = time.monotonic_ns()
            for chunk in got:
                record(chunk["data"], now)
        adapter.stop()
        conn.close()
    elif kind == "raw_threads":
        more = lambda: seen < total and time.monotonic() < deadline  # noqa: E731
        recv_relayed(url, f"{prefix}list:{rid}", more, record)
    else:
        client = redis.Redis.from_url(url)
        client.ping()
        emit({"ready": True, "pid": os.getpid()})
        while seen < total and time.monotonic() < deadline:
            popped: Any = client.blpop([f"{prefix}list:{rid}"], timeout=1)
            if popped is None:
                continue
            raw: Any = popped[1] if kind == "raw_blpop" else client.get(popped[1])
            if raw is not None:
                record(codec.decode(raw), time.monotonic_ns())
        client.close()
    emit({"lat_ns": lat, "missing": total - seen})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("side", choices=["send", "recv"])
    parser.add_argument(
        "kind", choices=["adapter", "raw_blpop", "raw_set_blpop_get", "raw_threads"]
    )
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--rid", required=True)
    parser.add_argument("-n", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=0)
    args = parser.parse_args()
    url = os.environ["OMNI_REDIS_URL"]
    if args.side == "send":
        send(args.kind, url, args.prefix, args.rid, args.n)
    else:
        recv(args.kind, url, args.prefix, args.rid, args.n, args.warmup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
