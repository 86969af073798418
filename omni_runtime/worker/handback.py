"""A draining worker hands back the inputs it could not finish: each goes to the stream's end
as a fresh entry, which any live replica reads at once.

Left pending instead, they would wait for a peer's takeover, which claims an entry only once
it has been idle for a heartbeat TTL (`takeover.py`): seconds of stall per request. Each is
copied, acknowledged and deleted in one transaction, so it is in the stream exactly once
whatever happens to this process meanwhile. The replica that takes it runs the request from
its start; the outputs this worker had already sent carry sequence numbers the orchestrator
has seen, and it drops the repeats (as after a takeover).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import redis
from redis.exceptions import RedisError

from omni_runtime import keys

log = logging.getLogger(__name__)


def hand_back(client: redis.Redis, stream: str, entry_ids: Iterable[bytes], maxlen: int) -> int:
    """Re-queue each still-pending entry of `stream` (group `workers`); the count handed back.
    An entry already gone (acknowledged and deleted meanwhile) is skipped; one that cannot be
    re-queued stays pending for a peer's takeover."""
    handed = 0
    for entry_id in entry_ids:
        try:
            found: Any = client.xrange(stream, entry_id, entry_id)
            if not found:
                continue
            fields = found[0][1]
            with client.pipeline(transaction=True) as pipe:
                pipe.xadd(stream, fields, maxlen=maxlen, approximate=True)
                pipe.xack(stream, keys.WORKERS_GROUP, entry_id)
                pipe.xdel(stream, entry_id)
                pipe.execute()
            handed += 1
        except RedisError as e:  # a peer's takeover claims it once the heartbeat is gone
            log.warning("handing back input %r failed: %r; left for a takeover", entry_id, e)
    return handed
