"""Redis Streams transport for the control plane: entries, dead letters, batched writes.

Every write goes through a `StreamWriter` that coalesces whatever accumulated
while the previous round trip was in flight into one pipeline; every read is
an XREADGROUP with COUNT. One round trip per message would cap a process at a
few thousand messages per second on loopback (research: redis_substrate §3c).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel
from redis.exceptions import RedisError, ResponseError

from omni_runtime import codec, keys
from omni_runtime.core.types import StageFailure, StageOutput
from omni_runtime.errors import CodecError
from omni_runtime.messages import AbortMsg, StageInputMsg, StageOutputMsg
from omni_runtime.redis_io.writer import StreamWriter as StreamWriter
from omni_runtime.redis_io.writer import xadd_fields as xadd_fields
from omni_runtime.tracing import Tracer

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
Entry = tuple[bytes, Mapping[bytes, bytes]]
DEAD_LETTER_RAW_BYTES = 4096
"""How much of a malformed entry's payload the dead-letter stream keeps."""


def entry_fields(msg: BaseModel) -> dict[str, bytes]:
    return {keys.PAYLOAD_FIELD: codec.encode_model(msg)}


# redis-py's stubs over-approximate: they type commands for every client configuration
# (RESP3 maps, `str` under decode_responses). Ours keep redis-py's defaults (legacy reply
# shapes, no decode_responses), so `stream_reply` below and `xadd_fields` (in
# `stream_writer`, its main user) only state the types to mypy; neither converts anything.


def stream_reply(reply: object) -> list[tuple[bytes, list[Entry]]]:
    """An XREAD / XREADGROUP reply, `[]` if none: `[[stream, [(id, fields), ...]], ...]`.

    Each `[stream, entries]` pair is a list at runtime; callers only unpack it.
    """
    return cast("list[tuple[bytes, list[Entry]]]", reply or [])


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
    client: aioredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    count: int,
    block_ms: int,
    start_id: str = ">",
) -> list[tuple[bytes, list[Entry]]]:
    """XREADGROUP that survives a Redis outage: log, back off, try again (never dies).

    `start_id="0"` re-reads what this consumer was given but never acknowledged (a
    previous run of the process that died), so nothing read before a crash is lost.
    """
    delay_s = 0.05
    while True:
        try:
            reply = await client.xreadgroup(
                group, consumer, {stream: start_id}, count=count, block=block_ms
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
        tracer: Tracer | None = None,
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
        self.tracer = tracer
        self.malformed_entries = 0
        self.duplicate_outputs = 0
        self._next_seq: dict[str, int] = {}
        self._unacked: deque[bytes] = deque()
        self._stopping = False
        self._reading = False
        self._start_id = "0"
        """Entries a previous orchestrator read but never acknowledged come first."""

    async def submit(self, request_id: str, data: Any) -> None:
        if self.tracer is not None:
            self.tracer.stamp("input_submitted", request_id, self.stage_id)
        msg = StageInputMsg(request_id=request_id, data=data, streaming=self.streaming)
        fields = entry_fields(msg)  # bad data raises here
        self.writer.xadd(self.in_stream, fields, urgent=True, trace=(request_id, self.stage_id))

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
                    keys.ORCHESTRATOR_CONSUMER,
                    self.read_count,
                    self.block_ms,
                    self._start_id,
                )
            finally:
                self._reading = False
            entries = [entry for _s, batch in reply for entry in batch]
            if self._start_id != ">":  # walk a previous run's backlog by id, then new entries
                self._start_id = entries[-1][0].decode() if entries else ">"
            outputs = self._parse(entries)
            if outputs:
                if self.tracer is not None:
                    for out in outputs:
                        self.tracer.stamp("output_returned", out.request_id, self.stage_id)
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
        t_ns = time.monotonic_ns() if self.tracer is not None else 0
        outputs: list[StageOutput] = []
        for entry_id, fields in entries:
            if not fields:  # pending, but trimmed from the stream since: nothing to handle
                self.writer.xack(self.out_stream, keys.ORCHESTRATOR_GROUP, entry_id)
                continue
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
            if self.tracer is not None:
                self.tracer.stamp("output_read", msg.request_id, self.stage_id, t_ns)
            self._unacked.append(entry_id)
        return outputs
