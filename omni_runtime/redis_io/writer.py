"""The batching writer of the control plane: every XADD / XACK / EXPIRE of a process.

Whatever accumulated while the previous round trip was in flight goes out as one
pipeline (see `transport`, which re-exports `StreamWriter`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from omni_runtime.tracing import Tracer

log = logging.getLogger(__name__)


def xadd_fields(fields: dict[str, Any]) -> dict[FieldT, EncodableT]:
    """`fields`, unchanged, as the type redis-py's `xadd` declares.

    The stub asks for a `dict[FieldT, EncodableT]`; dict is invariant, so it rejects our
    `dict[str, ...]` although every str key is a `FieldT` and xadd only reads the items.
    """
    return cast("dict[FieldT, EncodableT]", fields)


class StreamWriter:
    """Batches XADD / XACK / EXPIRE of one asyncio process into one pipeline per round trip."""

    MAX_ATTEMPTS = 20

    def __init__(self, client: aioredis.Redis, maxlen: int, tracer: Tracer | None = None) -> None:
        self.client = client
        self.maxlen = maxlen
        self.tracer = tracer
        self._traced: list[tuple[str, int]] = []
        """(request id, stage id) of the stage inputs queued since the last batch (tracing on)."""
        self._ops: list[tuple[str, tuple[Any, ...]]] = []
        self._done: list[asyncio.Future[bool]] = []
        self._urgent_queued = False
        """Resolved when the batch holding what was queued before them was written."""
        self._pending = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.dropped_writes = 0

    def xadd(
        self,
        stream: str,
        fields: dict[str, Any],
        maxlen: int | None = None,
        urgent: bool = False,
        trace: tuple[str, int] | None = None,
    ) -> None:
        """`urgent` entries (a stage's next input) go first in their pipeline: a hop's
        latency should not wait behind the outputs being delivered to clients. `trace`
        (request id, stage id) stamps when the pipeline carrying the entry starts and ends."""
        if trace is not None and self.tracer is not None:
            self._traced.append(trace)
        self._queue("xadd", stream, fields, maxlen or self.maxlen, urgent)

    def xack(self, stream: str, group: str, entry_id: bytes) -> None:
        self._queue("xack", stream, group, entry_id)

    def expire(self, key: str, ttl_s: int) -> None:
        self._queue("expire", key, ttl_s)

    def delete(self, key: str) -> None:
        self._queue("delete", key)

    @property
    def urgent_pending(self) -> bool:
        """Whether an urgent entry waits for the next pipeline."""
        return self._urgent_queued

    def _queue(self, op: str, *args: Any) -> None:
        if op == "xadd" and args[3]:
            self._urgent_queued = True
        self._ops.append((op, args))
        self._idle.clear()
        self._pending.set()

    async def flushed(self) -> None:
        """Wait until everything queued so far reached Redis (or was given up on)."""
        await self._idle.wait()

    async def written(self) -> bool:
        """Wait for the batch holding everything queued so far; False if it was given up on.

        Unlike `flushed`, later writes do not make the caller wait longer.
        """
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._done.append(done)
        self._pending.set()
        return await done

    async def run(self) -> None:
        while True:
            await self._pending.wait()
            self._pending.clear()
            ops, self._ops = self._ops, []
            self._urgent_queued = False
            done, self._done = self._done, []
            traced, self._traced = self._traced, []
            for rid, sid in traced:
                self.tracer.stamp("input_write_start", rid, sid)  # type: ignore[union-attr]
            try:
                ok = await self._write(ops) if ops else True
            except Exception:  # never die with callers waiting on `written`
                log.exception("stream writer failed on a batch of %d writes", len(ops))
                self.dropped_writes += len(ops)
                ok = False
            for rid, sid in traced:
                self.tracer.stamp("input_written", rid, sid)  # type: ignore[union-attr]
            for fut in done:
                if not fut.done():
                    fut.set_result(ok)
            if not self._ops:
                self._idle.set()

    @staticmethod
    def _fill(pipe: Any, ops: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Writes in order; then one XACK per stream with all its ids and one EXPIRE per
        key, after the writes they acknowledge (never an ack before its consequences)."""
        acks: dict[tuple[str, str], list[bytes]] = {}
        expires: dict[str, int] = {}
        ops = sorted(ops, key=lambda o: not (o[0] == "xadd" and o[1][3]))  # stable: urgent first
        for op, args in ops:
            if op == "xadd":
                pipe.xadd(args[0], xadd_fields(args[1]), maxlen=args[2], approximate=True)
            elif op == "xack":
                acks.setdefault((args[0], args[1]), []).append(args[2])
            elif op == "expire":
                expires[args[0]] = max(args[1], expires.get(args[0], 0))
            else:
                pipe.delete(args[0])
        for (stream, group), ids in acks.items():
            pipe.xack(stream, group, *ids)
        for key, ttl_s in expires.items():
            pipe.expire(key, ttl_s)

    async def _write(self, ops: list[tuple[str, tuple[Any, ...]]]) -> bool:
        delay_s = 0.01
        for attempt in range(1, self.MAX_ATTEMPTS + 1):
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    self._fill(pipe, ops)
                    await pipe.execute()
                return True
            except RedisError as e:
                if attempt == self.MAX_ATTEMPTS:
                    self.dropped_writes += len(ops)
                    log.error(
                        "giving up on %d stream writes after %d attempts: %r", len(ops), attempt, e
                    )
                    return False
                log.warning("stream write failed (attempt %d), retrying: %r", attempt, e)
                await asyncio.sleep(delay_s)
                delay_s = min(1.0, delay_s * 2)
        return False
