"""Counts every stage submission Redis executes, as Redis sees it (MONITOR).

Independent of what the orchestrators believe they wrote: a deposed orchestrator's
late XADD to a stage's input stream would show here as a second submission of
the same request to the same stage.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections import Counter
from typing import Any

import redis

from omni_runtime.wire import codec

ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
ESCAPES = {ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("a"): 7, ord("b"): 8}


def unescape(text: bytes) -> bytes:
    """Undo Redis's `sdscatrepr` quoting of one MONITOR argument."""
    out = bytearray()
    i = 0
    while i < len(text):
        c = text[i]
        if c != ord("\\"):
            out.append(c)
            i += 1
        elif text[i + 1] == ord("x"):
            out.append(int(text[i + 2 : i + 4], 16))
            i += 4
        else:
            out.append(ESCAPES.get(text[i + 1], text[i + 1]))
            i += 2
    return bytes(out)


class SubmissionCounter:
    """`counts[(stage id, request id)]`: XADDs to `<ns>:stage:<k>:in` Redis executed."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.prefix = f"{namespace}:stage:".encode()
        self.counts: Counter[tuple[int, str]] = Counter()
        self._conn: Any = None
        self._started = threading.Event()
        self._marker = f"{namespace}:monitor-caught-up:{uuid.uuid4().hex}".encode()
        self._caught_up = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)

    def __enter__(self) -> SubmissionCounter:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.get(self._marker)  # MONITOR lags under load: read up to this command
        self._caught_up.wait(60)
        if self._conn is not None:
            self._conn.disconnect()
        self._thread.join(10)
        self.client.close()

    @property
    def caught_up(self) -> bool:
        return self._caught_up.is_set()

    def doubles(self) -> dict[tuple[int, str], int]:
        return {key: n for key, n in self.counts.items() if n > 1}

    def _run(self) -> None:
        conn = self._conn = self.client.connection_pool.get_connection()
        conn.send_command("MONITOR")
        conn.read_response()
        self._started.set()
        try:
            while True:
                self._count(conn.read_response())
        except Exception:  # disconnected by __exit__
            return

    def _count(self, line: bytes) -> None:
        if self._marker in line:
            self._caught_up.set()
            return
        args = [unescape(a) for a in ARG.findall(line)]
        if len(args) < 4 or args[0].upper() != b"XADD" or not args[1].startswith(self.prefix):
            return
        stage, _, kind = args[1][len(self.prefix) :].partition(b":")
        if kind != b"in":
            return
        msg = codec.decode(args[-1])
        self.counts[(int(stage), str(msg["request_id"]))] += 1
