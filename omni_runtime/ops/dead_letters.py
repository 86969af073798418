"""`omni-runtime dead-letters`: list what was dead-lettered, and put one entry back.

A dead letter (written by the orchestrator and workers) has the fields `stream`
(where the entry was read), `id` (its id there), `error`, and `raw` (its payload,
cut at 4 KiB). The list names the requests a payload is for (what a client's error and
`X-Omni-Request-Id` name), read from its msgpack front to back, so a cut one still
gives the ids before the cut; nothing in it is run or unpickled. Replaying re-adds
`raw` as the payload field to its original stream, then deletes the dead letter, so
one entry is never replayed twice.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import redis
from rich.console import Console
from rich.table import Table

from omni_runtime import keys
from omni_runtime.errors import ConfigError
from omni_runtime.ops.flags import add_dead_letters_arguments as add_dead_letters_arguments
from omni_runtime.redis_io.clients import is_cluster
from omni_runtime.settings import Settings

RAW_CUT_BYTES = 4096
"""The writers keep this much of a payload (`redis_io.stage_client.DEAD_LETTER_RAW_BYTES`)."""
MAX_LIST = 10_000
SHOWN_REQUESTS = 3
"""A batch's payload names this many of its requests at most."""
ARRAY_HEADS = {*range(0x90, 0xA0), 0xDC, 0xDD}
"""msgpack's first bytes of an array (a batch of messages); a message is a map."""


@dataclass
class DeadLetter:
    id: str
    time: float
    stream: str
    entry_id: str
    error: str
    raw_bytes: int
    request_ids: list[str]


def _s(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _letter(entry_id: Any, fields: dict[bytes, bytes]) -> DeadLetter:
    eid = _s(entry_id)
    return DeadLetter(
        id=eid,
        time=int(eid.split("-", 1)[0]) / 1000,
        stream=_s(fields.get(b"stream", b"")),
        entry_id=_s(fields.get(b"id", b"")),
        error=_s(fields.get(b"error", b"")),
        raw_bytes=len(fields.get(b"raw", b"")),
        request_ids=request_ids(fields.get(b"raw", b"")),
    )


def request_ids(raw: bytes) -> list[str]:
    """The `request_id` of each message in a payload (a map, or an array of maps), up to
    `SHOWN_REQUESTS`, as far as the bytes go: none of a payload that is not one."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(raw) + 1)
    unpacker.feed(raw)
    found: list[str] = []
    try:
        messages = unpacker.read_array_header() if raw[:1] and raw[0] in ARRAY_HEADS else 1
        for _ in range(min(messages, SHOWN_REQUESTS)):
            for _pair in range(unpacker.read_map_header()):
                if unpacker.unpack() == "request_id":
                    found.append(str(unpacker.unpack()))
                else:
                    unpacker.skip()
    except (msgpack.OutOfData, ValueError, TypeError):  # cut, or not a message
        pass
    return found


def list_dead_letters(client: redis.Redis, names: keys.Names, limit: int = 100) -> list[DeadLetter]:
    """The newest `limit` dead letters, newest first."""
    entries: Any = client.xrevrange(names.dead_letters, "+", "-", count=min(limit, MAX_LIST))
    return [_letter(eid, fields) for eid, fields in entries]


def replay(
    client: redis.Redis,
    names: keys.Names,
    dead_id: str,
    force: bool = False,
    maxlen: int = keys.STREAM_MAXLEN,
) -> str:
    """Re-queue dead letter `dead_id` onto its original stream; returns the new entry id.

    Refused when the stream is outside the namespace, or the payload was cut
    (a cut payload can only fail again) unless `force`.
    """
    entries: Any = client.xrange(names.dead_letters, dead_id, dead_id, count=1)
    if not entries:
        raise ConfigError(f"no dead letter {dead_id} in {names.dead_letters}")
    fields: dict[bytes, bytes] = entries[0][1]
    stream = _s(fields.get(b"stream", b""))
    raw = fields.get(b"raw", b"")
    if not stream.startswith(names.prefix) or stream == names.dead_letters:
        raise ConfigError(
            f"dead letter {dead_id} names stream {stream!r}, not one of this namespace"
        )
    if not raw:
        raise ConfigError(f"dead letter {dead_id} has no payload to replay")
    if len(raw) >= RAW_CUT_BYTES and not force:
        raise ConfigError(
            f"dead letter {dead_id}: its payload was cut at {RAW_CUT_BYTES} bytes; --force to replay anyway"
        )
    # One transaction on a single Redis; on a cluster the two streams have slots of their
    # own, so the entry is re-queued first and its dead letter deleted once that is in (one
    # cluster pipeline writes its nodes in no order).
    if is_cluster(client):
        new_id = client.xadd(stream, {keys.PAYLOAD_FIELD: raw}, maxlen=maxlen, approximate=True)
        client.xdel(names.dead_letters, dead_id)
        return _s(new_id)
    with client.pipeline(transaction=True) as pipe:
        pipe.xadd(stream, {keys.PAYLOAD_FIELD: raw}, maxlen=maxlen, approximate=True)
        pipe.xdel(names.dead_letters, dead_id)
        new_id, _ = pipe.execute()
    return _s(new_id)


def run_dead_letters(
    args: argparse.Namespace,
    settings: Settings,
    client: redis.Redis | None = None,
    console: Console | None = None,
) -> int:
    """The `dead-letters` subcommand."""
    if client is None:
        from omni_runtime.ops.status import connect

        client = connect(settings)
    if console is None:
        console = Console(width=None if sys.stdout.isatty() else 160)
    names = settings.names
    if args.replay:
        new_id = replay(client, names, args.replay, force=args.force, maxlen=settings.stream_maxlen)
        if args.json:
            console.file.write(json.dumps({"replayed": args.replay, "new_id": new_id}) + "\n")
        else:
            console.print(f"replayed {args.replay} as {new_id}")
        return 0
    letters = list_dead_letters(client, names, args.limit)
    if args.json:
        console.file.write(json.dumps([asdict(d) for d in letters], indent=1) + "\n")
        return 0
    total = client.xlen(names.dead_letters)
    table = Table(title=f"{total} dead letters in {names.dead_letters} (newest first)")
    for col in ("id", "time (UTC)", "stream", "entry id", "request", "bytes", "error"):
        table.add_column(col, overflow="fold")
    import datetime as dt

    for d in letters:
        when = dt.datetime.fromtimestamp(d.time, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        stream = d.stream.removeprefix(names.prefix)
        requests = ", ".join(d.request_ids) or "?"
        table.add_row(d.id, when, stream, d.entry_id, requests, str(d.raw_bytes), d.error)
    console.print(table)
    return 0
