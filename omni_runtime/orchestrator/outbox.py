"""Where the orchestrator process's outputs go: each request's client stream, numbered.

Every output of a request carries the next `seq` (0, 1, 2, …), so the client can
drop repeats and notice a gap (SPEC §6). Outputs for one client that leave in the same
round trip share one stream entry (a batch), up to `max_message_bytes`. Each message
is an `OrchOutputOut` (made from `OrchOutputMsg`, which the client validates it as):
every field comes from state the orchestrator already validated. Both maps follow the
requests in flight:
an entry is made when the request is read and dropped with its final output.
"""

from __future__ import annotations

import logging
from typing import Any

from omni_runtime import keys
from omni_runtime.core.types import OrchOutput
from omni_runtime.redis_io.writer import StreamWriter
from omni_runtime.wire import outgoing
from omni_runtime.wire.messages import clip_error
from omni_runtime.wire.outgoing import OrchOutputOut

log = logging.getLogger(__name__)


class ClientOutbox:
    """Numbers and writes each `OrchOutput` to the stream of the client that asked."""

    def __init__(
        self, writer: StreamWriter, names: keys.Names, stream_ttl_s: int, max_message_bytes: int
    ) -> None:
        self.writer = writer
        self.names = names
        self.stream_ttl_s = stream_ttl_s
        self.max_message_bytes = max_message_bytes
        self.client_of: dict[str, str] = {}
        """request id → client id, for the requests in flight."""
        self._seq: dict[str, int] = {}
        """request id → the seq of its next output."""

    def __len__(self) -> int:
        return len(self.client_of)

    def next_seq(self, request_id: str) -> int:
        """The seq the request's next output will carry (what a durable state records)."""
        return self._seq.get(request_id, 0)

    def restore(self, request_id: str, client_id: str, next_seq: int) -> None:
        """A request taken over: its client already has the outputs below `next_seq`."""
        self.client_of[request_id] = client_id
        self._seq[request_id] = next_seq

    def send(self, out: OrchOutput) -> None:
        rid = out.request_id
        client_id = self.client_of.get(rid)
        seq = self._seq.pop(rid, 0)
        if out.finished:
            self.client_of.pop(rid, None)
        else:
            self._seq[rid] = seq + 1
        if client_id is None:
            log.warning("output for %r has no client; dropped", rid, extra={"request_id": rid})
            return
        self._write(client_id, rid, out.stage_id, out.data, out.finished, out.error, seq, out)

    def refuse(self, request_id: str, client_id: str, error: str) -> None:
        """Answer a request that will not run with its one error final (seq 0)."""
        self._write(client_id, request_id, 0, None, True, error, 0)

    def _write(
        self,
        client_id: str,
        request_id: str,
        stage_id: int,
        data: Any,
        finished: bool,
        error: str | None,
        seq: int,
        out: OrchOutput | None = None,
    ) -> None:
        """One output to the client's stream; `out` adds what the stage said of its end."""
        usage = None if out is None else out.usage
        msg = OrchOutputOut(
            request_id=request_id,
            stage_id=stage_id,
            data=data,  # as a stage's output was read
            finished=finished,
            error=None if error is None else clip_error(error),
            seq=seq,
            error_code=None if out is None else out.error_code,
            finish_reason=None if out is None else out.finish_reason,
            prompt_tokens=None if usage is None else usage.prompt_tokens,
            completion_tokens=None if usage is None else usage.completion_tokens,
            cached_tokens=None if usage is None else usage.cached_tokens,
        )
        stream = self.names.client_out(client_id)
        fields = {keys.PAYLOAD_FIELD: outgoing.encode(msg)}
        self.writer.xadd(stream, fields, merge_up_to=self.max_message_bytes, owner=request_id)
        self.writer.expire(stream, self.stream_ttl_s)
