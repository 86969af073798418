"""The small costs the code's choices rest on, measured in one run (docs/performance.md).

Each row times one operation and the alternative the code chose against, interleaved
(A, B, A, B, … per repetition), and gives medians and p99 per call and their ratio. The
code's docstrings say why a choice was made; the figures, which depend on the machine,
live here and in docs/performance.md.

    python -m benchmarks.micro [--quick] [--redis-url URL]

Without `--redis-url` a private redis-server is started for the rows that need one.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import redis
import redis.cluster
from pydantic import TypeAdapter
from redis.connection import PythonRespSerializer

from benchmarks.harness.redis import redis_for_run
from omni_runtime.chunks.snapshot import snapshot
from omni_runtime.local.redis_cluster import RedisCluster
from omni_runtime.redis_io import conn as rconn
from omni_runtime.redis_io.clients import sync_client
from omni_runtime.redis_io.raw_reads import xreadgroup_sync
from omni_runtime.redis_io.write_ops import XAdd
from omni_runtime.wire import codec, outgoing
from omni_runtime.wire.messages import StageOutputMsg
from omni_runtime.wire.outgoing import OrchOutputOut, StageOutputOut
from omni_runtime.wire.views import StageOutputView, decode_views

RESULTS = Path(__file__).resolve().parent / "results" / "micro.json"


@dataclass(frozen=True, slots=True)
class FrozenXAdd:
    """`write_ops.XAdd` as a frozen dataclass: what it is not, and why."""

    stream: str
    fields: dict[str, Any]
    maxlen: int
    urgent: bool = False
    max_age_s: float | None = None
    merge_up_to: int = 0
    owner: str | None = None


Op = Callable[[], Any]


def _per_call_us(op: Op, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        op()
    return (time.perf_counter_ns() - start) / calls / 1000


def pair(name: str, chosen: Op, other: Op, reps: int, calls: int) -> dict[str, Any]:
    """`chosen` and `other`, `reps` times each, interleaved; µs per call."""
    a: list[float] = []
    b: list[float] = []
    chosen(), other()  # warm
    for _ in range(reps):
        a.append(_per_call_us(chosen, calls))
        b.append(_per_call_us(other, calls))

    def p99(xs: list[float]) -> float:
        return statistics.quantiles(xs, n=100)[98] if len(xs) > 1 else xs[0]

    return {
        "name": name,
        "chosen_us": statistics.median(a),
        "chosen_p99_us": p99(a),
        "other_us": statistics.median(b),
        "other_p99_us": p99(b),
        "ratio": statistics.median(b) / statistics.median(a),
    }


def output_as_dict(rid: str, data: Any, seq: int) -> bytes:
    """A stage output as the worker wrote it before `wire.outgoing`: a dict literal."""
    msg = {"v": 1, "type": "stage_output", "request_id": rid, "data": data, "finished": False}
    return codec.encode(msg | {"error": None, "seq": seq})


def output_as_struct(rid: str, data: Any, seq: int) -> bytes:
    """A stage output as the worker writes it: its data once (`codec.encode_raw`), then
    the `StageOutputOut` around it."""
    raw = codec.encode_raw(data)
    return outgoing.encode(StageOutputOut(request_id=rid, data=raw, finished=False, seq=seq))


def output_and_chunk_as_dicts(rid: str, data: Any, seq: int) -> bytes:
    """A streaming stage's output and chunk before: the output whole (to measure it, even
    when not sent), a snapshot for the SAVE thread, the chunk encoded there again."""
    output_as_dict(rid, data, seq)
    return codec.encode({"data": snapshot(data), "finished": False})


def output_and_chunk_as_structs(rid: str, data: Any, seq: int) -> bytes:
    """And now: the data encoded once; the output and the chunk carry those bytes."""
    raw = codec.encode_raw(data)
    outgoing.encode(StageOutputOut(request_id=rid, data=raw, finished=False, seq=seq))
    return codec.encode_decoded({"data": snapshot(raw), "finished": False})


def client_output_as_dict(data: Any) -> bytes:
    """A client output as the outbox wrote it before `wire.outgoing`."""
    msg = {"v": 1, "type": "orch_output", "request_id": "r1", "stage_id": 1, "data": data}
    return codec.encode_decoded(msg | {"finished": False, "error": None, "seq": 3})


def client_output_as_struct(data: Any) -> bytes:
    msg = OrchOutputOut(request_id="r1", stage_id=1, data=data, finished=False, seq=3)
    return outgoing.encode(msg)


def in_process(reps: int, calls: int) -> list[dict[str, Any]]:
    small = ("XADD", "omni:stage:1:out", "MAXLEN", "~", 10000, "*", "m", b"x" * 200)
    python = PythonRespSerializer(6000, redis.ConnectionPool().get_encoder().encode)
    msg = {"v": 1, "type": "stage_output", "request_id": "r1", "data": "hello", "finished": False}
    raw = codec.encode({**msg, "error": None, "seq": 3})
    chunk = {"tokens": list(range(64)), "text": "a talker's chunk", "pcm": np.zeros(480)}
    relayed = msgspec.Raw(codec.encode(chunk))
    return [
        pair(
            "pack a small XADD: hiredis (conn.pack_small) / redis-py's Python packer",
            lambda: rconn.pack_small(small),
            lambda: python.pack(*small),
            reps,
            calls,
        ),
        pair(
            "read a stage output: msgspec view (wire.views) / msgpack + pydantic model",
            lambda: decode_views(raw, StageOutputView, False),
            lambda: StageOutputMsg.model_validate(codec.decode(raw)),
            reps,
            calls,
        ),
        pair(
            "write a stage output (a token): outgoing struct / a pydantic model",
            lambda: output_as_struct("r1", "hello", 3),
            lambda: codec.encode_model(
                StageOutputMsg(request_id="r1", data="hello", seq=3, finished=False)
            ),
            reps,
            calls,
        ),
        pair(
            "write a stage output (a token): outgoing struct / a dict literal",
            lambda: output_as_struct("r1", "hello", 3),
            lambda: output_as_dict("r1", "hello", 3),
            reps,
            calls,
        ),
        pair(
            "write a stage output (audio chunk): outgoing struct / a dict literal",
            lambda: output_as_struct("r1", chunk, 3),
            lambda: output_as_dict("r1", chunk, 3),
            reps,
            calls,
        ),
        pair(
            "a streaming output and its chunk (audio): data encoded once / twice + snapshot",
            lambda: output_and_chunk_as_structs("r1", chunk, 3),
            lambda: output_and_chunk_as_dicts("r1", chunk, 3),
            reps,
            calls,
        ),
        pair(
            "write a client output (relayed audio): outgoing struct / a dict literal",
            lambda: client_output_as_struct(relayed),
            lambda: client_output_as_dict(relayed),
            reps,
            calls,
        ),
        pair(
            "snapshot a chunk: chunks.snapshot / copy.deepcopy",
            lambda: snapshot(chunk),
            lambda: copy.deepcopy(chunk),
            reps,
            calls,
        ),
        pair(
            "an op: slotted dataclass (write_ops.XAdd) / a frozen one",
            lambda: XAdd("s", {}, 10, owner="r"),
            lambda: FrozenXAdd("s", {}, 10, owner="r"),
            reps,
            calls,
        ),
        pair(
            "a validator: built once (entries) / a TypeAdapter built per message",
            lambda: StageOutputMsg.model_validate(codec.decode(raw)),
            lambda: TypeAdapter(StageOutputMsg).validate_python(codec.decode(raw)),
            reps,
            max(1, calls // 10),
        ),
    ]


def with_redis(url: str, reps: int, calls: int) -> list[dict[str, Any]]:
    client = sync_client(url)
    own = redis.Redis(connection_pool=client.connection_pool, single_connection_client=True)
    stream, group = "omni-bench-micro", "g"
    client.delete(stream)
    client.xgroup_create(stream, group, id="0", mkstream=True)
    client.xadd(stream, {"m": b"x" * 100})
    pool = client.connection_pool
    conn = rconn.take(pool)
    rconn.give_back(pool, conn)
    try:
        return [
            pair(
                "XREADGROUP of a pending entry: packed by hand (raw_reads) / redis-py's command",
                lambda: xreadgroup_sync(own, group, "c", {stream: "0"}, 1, 0),
                lambda: own.xreadgroup(group, "c", {stream: "0"}, 1, 0),
                reps,
                calls,
            ),
            pair(
                "a held connection (redis_packed.HeldPuts) / a pool's get and release",
                lambda: conn,
                lambda: rconn.give_back(pool, rconn.take(pool)),
                reps,
                calls,
            ),
        ]
    finally:
        client.delete(stream)
        own.close()
        client.close()


def on_cluster(reps: int, calls: int) -> list[dict[str, Any]]:
    """A private 3-primary Redis Cluster: a stream read, routed by its slot here against
    redis-py's cluster client, which asks a node for the read's keys first."""
    with RedisCluster(masters=3, replicas=0) as cluster:
        routed = sync_client(cluster.url, cluster=True)
        plain = redis.cluster.RedisCluster.from_url(cluster.url)
        stream = "omni-bench-micro"
        routed.xadd(stream, {"m": b"x" * 100})
        try:
            return [
                pair(
                    "XREAD on a Redis Cluster: routed by the stream's slot (conn.read_stream) "
                    "/ redis-py's",
                    lambda: routed.xread({stream: "0-0"}, count=1),
                    lambda: plain.xread({stream: "0-0"}, count=1),
                    reps,
                    calls,
                )
            ]
        finally:
            routed.delete(stream)
            routed.close()
            plain.close()


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'operation':<84} {'chosen µs':>10} {'p99':>7} {'other µs':>10} {'p99':>7} {'ratio':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['name']:<84} {r['chosen_us']:>10.2f} {r['chosen_p99_us']:>7.2f} "
            f"{r['other_us']:>10.2f} {r['other_p99_us']:>7.2f} {r['ratio']:>6.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--redis-url")
    args = parser.parse_args(argv)
    reps, calls = (5, 500) if args.quick else (21, 2000)
    rows = in_process(reps, calls)
    with redis_for_run(args.redis_url) as url:
        rows += with_redis(url, reps, max(1, calls // 5))
    rows += on_cluster(reps, max(1, calls // 5))
    print(table(rows))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2))
    print(f"results written to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
