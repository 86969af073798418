"""Redis Streams transport for the control plane: entries, dead letters, batched writes.

Every write goes through a `StreamWriter` that coalesces whatever accumulated
while the previous round trip was in flight into one pipeline; every read is
an XREADGROUP with COUNT. One round trip per message would cap a process at a
few thousand messages per second on loopback (research: redis_substrate §3c).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel
from redis.exceptions import RedisError, ResponseError
from redis.typing import EncodableT, FieldT

from omni_runtime import codec, keys
from omni_runtime.errors import CodecError
from omni_runtime.messages import AbortMsg, StageInputMsg, StageOutputMsg
from omni_runtime.types import StageFailure, StageOutput

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
Entry = tuple[bytes, Mapping[bytes, bytes]]
DEAD_LETTER_RAW_BYTES = 4096
"""How much of a malformed entry's payload the dead-letter stream keeps."""


def entry_fields(msg: BaseModel) -> dict[str, bytes]:
    return {keys.PAYLOAD_FIELD: codec.encode_model(msg)}


# redis-py's stubs over-approximate: they type commands for every client configuration
# (RESP3 maps, `str` under decode_responses). Ours keep redis-py's defaults (legacy reply
# shapes, no decode_responses), so the two helpers below only state the types to mypy;
# neither converts anything.


def stream_reply(reply: object) -> list[tuple[bytes, list[Entry]]]:
    """An XREAD / XREADGROUP reply, `[]` if none: `[[stream, [(id, fields), ...]], ...]`.

    Each `[stream, entries]` pair is a list at runtime; callers only unpack it.
    """
    return cast("list[tuple[bytes, list[Entry]]]", reply or [])


def xadd_fields(fields: dict[str, Any]) -> dict[FieldT, EncodableT]:
    """`fields`, unchanged, as the type redis-py's `xadd` declares.

    The stub asks for a `dict[FieldT, EncodableT]`; dict is invariant, so it rejects our
    `dict[str, ...]` although every str key is a `FieldT` and xadd only reads the items.
    """
    return cast("dict[FieldT, EncodableT]", fields)


def parse_entry(fields: Mapping[bytes, bytes], model: type[M], max_bytes: int) -> M:
    """Validate one stream entry into `model`; anything else is a `CodecError`."""
    raw = fields.get(keys.PAYLOAD_FIELD.encode())
    if raw is None or len(fields) != 1:
        raise CodecError(f"entry must have exactly the field {keys.PAYLOAD_FIELD!r}")
    return codec.decode_model(raw, model, max_bytes=max_bytes)


def dead_letter_fields(
    stream: str, entry_id: bytes, error: str, fields: Mapping[bytes, bytes]
) -> dict[str, Any]:
    raw = b"".join(fields.values())[:DEAD_LETTER_RAW_BYTES] if fields else b""
    return {"stream": stream, "id": entry_id, "error": error[:1000], "raw": raw}


def ensure_group_sync(client: redis.Redis, stream: str, group: str) -> None:
    """Create the group from id 0 so entries written before it existed are still read."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


async def read_group(
    client: aioredis.Redis, stream: str, group: str, consumer: str, count: int, block_ms: int
) -> list[tuple[bytes, list[Entry]]]:
    """XREADGROUP that survives a Redis outage: log, back off, try again (never dies)."""
    delay_s = 0.05
    while True:
        try:
            reply = await client.xreadgroup(
                group, consumer, {stream: ">"}, count=count, block=block_ms
            )
            return stream_reply(reply)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            log.warning("group %s of %s vanished; recreating it", group, stream)
            await ensure_group(client, stream, group)
        except RedisError as e:
            log.warning("reading %s failed, retrying in %.2fs: %r", stream, delay_s, e)
            await asyncio.sleep(delay_s)
            delay_s = min(2.0, delay_s * 2)


class StreamWriter:
    """Batches XADD / XACK / EXPIRE of one asyncio process into one pipeline per round trip."""

    MAX_ATTEMPTS = 20

    def __init__(self, client: aioredis.Redis, maxlen: int) -> None:
        self.client = client
        self.maxlen = maxlen
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
    ) -> None:
        """`urgent` entries (a stage's next input) go first in their pipeline: a hop's
        latency should not wait behind the outputs being delivered to clients."""
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
            try:
                ok = await self._write(ops) if ops else True
            except Exception:  # never die with callers waiting on `written`
                log.exception("stream writer failed on a batch of %d writes", len(ops))
                self.dropped_writes += len(ops)
                ok = False
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


class RedisStageClient:
    """The orchestrator's view of one stage over Redis: the SPEC §2 stage protocol.

    `submit` queues an XADD on the stage's input stream; `get_output` blocks on
    the stage's output stream. Entries are acknowledged only once the
    dispatcher handled them (`output_handled`), in the order they were read.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        writer: StreamWriter,
        stage_id: int,
        names: keys.Names,
        *,
        read_count: int,
        block_ms: int,
        max_message_bytes: int,
        streaming: bool = False,
    ) -> None:
        self.client = client
        self.writer = writer
        self.stage_id = stage_id
        self.in_stream = names.stage_in(stage_id)
        self.out_stream = names.stage_out(stage_id)
        self.dead_letters = names.dead_letters
        self.control = names.control
        self.read_count = read_count
        self.block_ms = block_ms
        self.max_message_bytes = max_message_bytes
        self.streaming = streaming
        self.malformed_entries = 0
        self.duplicate_outputs = 0
        self._next_seq: dict[str, int] = {}
        self._unacked: deque[bytes] = deque()
        self._stopping = False
        self._reading = False

    async def submit(self, request_id: str, data: Any) -> None:
        msg = StageInputMsg(request_id=request_id, data=data, streaming=self.streaming)
        self.writer.xadd(self.in_stream, entry_fields(msg), urgent=True)  # bad data raises here

    async def abort(self, request_id: str) -> None:
        """Broadcast on the control stream: whichever worker holds the request drops it."""
        self.writer.xadd(self.control, entry_fields(AbortMsg(request_id=request_id)))

    async def quiesce(self, timeout_s: float = 5.0) -> None:
        """Stop reading between two reads, so shutdown never cuts a blocking read in half
        (entries it delivered would stay pending; some clients hang on it)."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._reading and loop.time() < deadline:
            await asyncio.sleep(0.005)

    async def get_output(self) -> list[StageOutput]:
        while True:
            if self._stopping:
                await asyncio.get_running_loop().create_future()  # parked until cancelled
            self._reading = True
            try:
                reply = await read_group(
                    self.client,
                    self.out_stream,
                    keys.ORCHESTRATOR_GROUP,
                    "orchestrator",
                    self.read_count,
                    self.block_ms,
                )
            finally:
                self._reading = False
            outputs = [out for _s, entries in reply or [] for out in self._parse(entries)]
            if outputs:
                return outputs

    def _in_sequence(self, msg: StageOutputMsg) -> bool:
        """Drop outputs a re-run repeats (seq already seen); errors always pass."""
        rid = msg.request_id
        expected = self._next_seq.get(rid, 0)
        if msg.seq < expected and msg.error is None:
            self.duplicate_outputs += 1
            return False
        if msg.finished or msg.error is not None:
            self._next_seq.pop(rid, None)
        else:
            self._next_seq[rid] = msg.seq + 1
        return True

    def output_handled(self, _out: StageOutput) -> None:
        self.writer.xack(self.out_stream, keys.ORCHESTRATOR_GROUP, self._unacked.popleft())

    def _parse(self, entries: list[Entry]) -> list[StageOutput]:
        outputs: list[StageOutput] = []
        for entry_id, fields in entries:
            try:
                msg = parse_entry(fields, StageOutputMsg, self.max_message_bytes)
            except CodecError as e:
                self.malformed_entries += 1
                log.error(
                    "malformed entry %s on %s dead-lettered: %s", entry_id, self.out_stream, e
                )
                self.writer.xadd(
                    self.dead_letters,
                    dead_letter_fields(self.out_stream, entry_id, str(e), fields),
                    keys.DEAD_LETTER_MAXLEN,
                )
                self.writer.xack(self.out_stream, keys.ORCHESTRATOR_GROUP, entry_id)
                continue
            if not self._in_sequence(msg):
                self.writer.xack(self.out_stream, keys.ORCHESTRATOR_GROUP, entry_id)
                continue
            data = (
                StageFailure(f"stage {self.stage_id} failed: {msg.error}")
                if msg.error
                else msg.data
            )
            outputs.append(StageOutput(msg.request_id, data, msg.finished or msg.error is not None))
            self._unacked.append(entry_id)
        return outputs
