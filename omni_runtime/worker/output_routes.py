"""Which orchestrator slot's output stream gets each request's outputs.

A request's input names the slot that owns it (`StageInputMsg.owner`); its outputs go to
that slot's stream (`Names.stage_out`). Owners of ended requests are kept a while, so an
error output published after a request's final still finds its way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from omni_runtime.worker.actions import Input, Outgoing

ENDED_ROUTES = 10_000
"""Owners of ended requests remembered, for an error output published after the end."""


class OwnerRoutes:
    """Recorded by the loop as inputs arrive, read by whichever thread routes a batch."""

    def __init__(self, slot_stream: Callable[[int], str]) -> None:
        self.slot_stream = slot_stream
        self._owner: dict[str, int] = {}
        self._ended: OrderedDict[str, int] = OrderedDict()

    def record(self, inputs: Sequence[Input]) -> None:
        """Who owns each request, before any output of it is published."""
        for inp in inputs:
            self._owner[inp.msg.request_id] = inp.msg.owner

    def stream_of(self, out: Outgoing) -> str:
        rid = out.request_id
        slot = self._owner.pop(rid, None) if out.ends else self._owner.get(rid)
        if slot is None:
            slot = self._ended.get(rid, 0)
        elif out.ends:
            self._ended[rid] = slot
            if len(self._ended) > ENDED_ROUTES:
                self._ended.popitem(last=False)
        return self.slot_stream(slot)
