"""Raw Redis Streams hand-off, the baseline of `hops.py`: no omni-runtime code on the path.

`consumer --stream S`: XREADGROUP BLOCK (COUNT 100, XACK after) and, per "flush"
entry, prints the one-way latencies it saw (its read - the producer's stamp, ns).
`producer --stream S -n N [--asyncio]`: N ~200 B msgpack entries U(2, 4) ms apart,
stamped just before each XADD, then "flush"; exits. `--asyncio` produces from
redis.asyncio on an event loop, as the orchestrator does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
from typing import Any

import msgpack
import redis
import redis.asyncio as aioredis

from benchmarks.roles import emit

PAD = os.urandom(160)  # + seq + stamp + framing ~ 200 B


def message(seq: int) -> bytes:
    packed: bytes = msgpack.packb({"seq": seq, "t": time.monotonic_ns(), "pad": PAD})
    return packed


def consume(url: str, stream: str) -> None:
    client = redis.Redis.from_url(url)
    with contextlib.suppress(redis.ResponseError):
        client.xgroup_create(stream, "raw", id="$", mkstream=True)
    emit({"ready": True, "pid": os.getpid()})
    samples: list[int] = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        reply: Any = client.xreadgroup("raw", "c", {stream: ">"}, count=100, block=100)
        t = time.monotonic_ns()
        for _s, entries in reply or []:
            for eid, fields in entries:
                msg = msgpack.unpackb(fields[b"m"])
                client.xack(stream, "raw", eid)
                if msg.get("op") == "exit":
                    return
                if msg.get("op") == "flush":
                    emit({"samples_ns": samples})
                    samples = []
                else:
                    samples.append(t - msg["t"])


def produce(url: str, stream: str, n: int) -> None:
    client = redis.Redis.from_url(url)
    for i in range(n):
        client.xadd(stream, {"m": message(i)}, maxlen=10_000, approximate=True)
        time.sleep(random.uniform(0.002, 0.004))
    client.xadd(stream, {"m": msgpack.packb({"op": "flush"})})
    client.close()


async def produce_async(url: str, stream: str, n: int) -> None:
    client = aioredis.Redis.from_url(url)
    for i in range(n):
        await client.xadd(stream, {"m": message(i)}, maxlen=10_000, approximate=True)
        await asyncio.sleep(random.uniform(0.002, 0.004))
    await client.xadd(stream, {"m": msgpack.packb({"op": "flush"})})
    await client.aclose()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("side", choices=["consumer", "producer"])
    parser.add_argument("--stream", required=True)
    parser.add_argument("-n", type=int, default=100)
    parser.add_argument("--asyncio", action="store_true")
    args = parser.parse_args()
    url = os.environ["OMNI_REDIS_URL"]
    if args.side == "consumer":
        consume(url, args.stream)
    elif args.asyncio:
        asyncio.run(produce_async(url, args.stream, args.n))
    else:
        produce(url, args.stream, args.n)
    emit({"done": True})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
