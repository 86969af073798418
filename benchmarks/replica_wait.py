"""What `WAIT 1` costs a write: a round trip that returns once a replica has the writes.

With asynchronous replication a write the primary acknowledged may die with it (see
docs/high-availability.md). `WAIT numreplicas timeout`, sent after a batch on the
same connection, returns once that many replicas acknowledged every earlier write.
The cost is what it adds to the batch's round trip.

A private primary and one replica (`RedisServer`, `--replicaof`), one connection.
Per configuration, `rounds` sequential round trips of a pipeline of `batch` XADDs
(the shape of the runtime's writes: one stream entry per output, batched), with and
without a trailing `WAIT 1 1000`; the configurations alternated round by round, so
both see the same machine. Rows: p50 of a round trip, the WAIT one against the
plain one (ratio), p50/p99 in the columns.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from benchmarks.harness import scenario
from benchmarks.harness.report import Row, ratio
from benchmarks.harness.stats import p50_p99_ms
from omni_runtime.local.redis_server import RedisServer

WAIT_TIMEOUT_MS = 1000


@dataclass(frozen=True)
class Sizes:
    rounds: int
    batches: tuple[int, ...]


FULL = Sizes(rounds=3000, batches=(1, 32, 256))
QUICK = Sizes(rounds=500, batches=(1, 32))


def synced(replica: redis.Redis) -> bool:
    return replica.info("replication").get("master_link_status") == "up"


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        primary = RedisServer(log_path=Path(tmp) / "primary.log", extra_args=("--dir", tmp))
        primary.start()
        replica_dir = Path(tmp) / "replica"
        replica_dir.mkdir()
        args = ("--dir", str(replica_dir), "--replicaof", "127.0.0.1", str(primary.port))
        replica = RedisServer(log_path=replica_dir / "replica.log", extra_args=args).start()
        try:
            return measure(primary, replica, sizes)
        finally:
            replica.stop()
            primary.stop()


def measure(primary: RedisServer, replica: RedisServer, sizes: Sizes) -> list[Row]:
    r = redis.Redis(port=primary.port)
    watch = redis.Redis(port=replica.port)
    deadline = time.monotonic() + 20
    while not synced(watch):
        if time.monotonic() > deadline:
            raise RuntimeError("the replica did not sync within 20 s")
        time.sleep(0.05)
    payload = b"x" * 200
    rows = []
    for batch in sizes.batches:
        samples: dict[bool, list[int]] = {False: [], True: []}
        acked: list[int] = []
        for i in range(sizes.rounds):
            for wait in (False, True) if i % 2 == 0 else (True, False):
                pipe = r.pipeline(transaction=False)
                for _ in range(batch):
                    pipe.xadd("bench:wait", {"p": payload}, maxlen=10_000, approximate=True)
                if wait:
                    pipe.execute_command("WAIT", 1, WAIT_TIMEOUT_MS)
                t0 = time.perf_counter_ns()
                replies = pipe.execute()
                samples[wait].append(time.perf_counter_ns() - t0)
                if wait:
                    acked.append(int(replies[-1]))
        plain_p50, plain_p99 = p50_p99_ms(samples[False])
        wait_p50, wait_p99 = p50_p99_ms(samples[True])
        assert plain_p50 is not None and wait_p50 is not None
        config = f"{batch} XADD{'s' * (batch > 1)} per round trip"
        rows.append(Row("replica wait", f"{config}, plain", "round trip p50", "ms",
                        plain_p50, p50_ms=plain_p50, p99_ms=plain_p99))  # fmt: skip
        rows.append(Row("replica wait", f"{config}, + WAIT 1", "round trip p50", "ms",
                        wait_p50, p50_ms=wait_p50, p99_ms=wait_p99, baseline=f"{config}, plain",
                        baseline_value=plain_p50, ratio=ratio(wait_p50, plain_p50),
                        notes=[f"WAIT answered 1 replica in {sum(acked)} of {len(acked)}"]))  # fmt: skip
    r.close()
    watch.close()
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("replica_wait", __doc__, run, FULL, QUICK))
