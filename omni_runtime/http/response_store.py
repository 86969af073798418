"""The responses a server keeps (`store`), for `previous_response_id` and
`GET /v1/responses/{id}`.

Each is kept in the deployment's Redis under its id, with a TTL (`OMNI_RESPONSES_TTL_S`),
so any replica of the server continues a conversation another one began, and a server
restarted goes on with them (not one that started a private Redis of its own, which
goes with it). A kept response holds the body it was answered with and its
conversation as input items: the items of the responses before it, its own input, then
its output as an assistant's turn. So a response that follows it is one read, whatever
the length of the chain; `instructions` are not among them (OpenAI's rule: each response
gives its own). What Redis hands back is validated as a request's input is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from omni_runtime.http.errors import ApiError
from omni_runtime.http.responses_request import FunctionCallItem, InputItem, MessageItem
from omni_runtime.observe.metrics import Metrics

log = logging.getLogger(__name__)

MAX_KEPT_BYTES = 16 * 1024 * 1024
"""A conversation larger than this is answered but not kept (`store: false` in its body)."""


class Kept(BaseModel):
    response: dict[str, Any]
    """The response object as it was answered."""
    history: list[InputItem]
    """The conversation up to and including this response's output, as input items."""
    inputs: int | None = None
    """How many of them were its input (the conversation before it and its own `input`)."""

    def input_items(self, response_id: str) -> list[dict[str, Any]]:
        """Its input items, oldest first, as `GET /v1/responses/{id}/input_items` lists
        them: each with an id of its own (`<kind>_<response>_<index>`)."""
        given = self.history[: self.inputs]
        return [
            _shown(item, f"{response_id.removeprefix('resp_')}_{k}") for k, item in enumerate(given)
        ]


def as_input(output: list[dict[str, Any]]) -> list[InputItem]:
    """A response's output items as the input items of the response that follows it."""
    items: list[InputItem] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            items.append(MessageItem(role="assistant", content=text))
        elif item["type"] == "function_call":
            items.append(
                FunctionCallItem(
                    type="function_call",
                    call_id=item["call_id"],
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
    return items


def _shown(item: InputItem, suffix: str) -> dict[str, Any]:
    if isinstance(item, FunctionCallItem):
        return {"id": f"fc_{suffix}", "type": "function_call", "status": "completed",
                "call_id": item.call_id, "name": item.name, "arguments": item.arguments}  # fmt: skip
    if isinstance(item, MessageItem):
        part: dict[str, Any] = {"type": "input_text", "text": item.text()}
        if item.role == "assistant":  # an answer before this response: OpenAI's output text
            part = {"type": "output_text", "text": item.text(), "annotations": []}
        return {"id": f"msg_{suffix}", "type": "message", "status": "completed",
                "role": item.role, "content": [part]}  # fmt: skip
    return {"id": f"fco_{suffix}", "type": "function_call_output", "status": "completed",
            "call_id": item.call_id, "output": item.output}  # fmt: skip


class ResponseStore:
    def __init__(
        self, redis: Redis, key: Callable[[str], str], ttl_s: int, metrics: Metrics
    ) -> None:
        """`key`: a response id's Redis name (`Names.kept_response`)."""
        self.redis, self.key, self.ttl_s, self.metrics = redis, key, ttl_s, metrics

    @property
    def keeps(self) -> bool:
        """False when the server keeps nothing (`OMNI_RESPONSES_TTL_S=0`)."""
        return self.ttl_s > 0

    async def get(self, response_id: str) -> Kept | None:
        """The kept response, or None (never kept, expired, deleted; or unreadable, which is
        logged); a 503 when Redis cannot say."""
        try:
            raw = await self.redis.get(self.key(response_id))
        except (RedisError, OSError) as e:
            raise ApiError(
                503, f"kept responses cannot be read: {type(e).__name__}", code="redis_unavailable"
            ) from e
        if raw is None:
            return None
        try:
            return Kept.model_validate_json(raw)
        except ValidationError as e:
            log.warning("kept response %s is unreadable, taken for gone: %s", response_id, e)
            self.metrics.inc("omni_malformed_entries_total", stream="kept responses")
            return None

    async def keep(self, response_id: str, kept: Kept) -> bool:
        """Keep a response for `ttl_s`; False (logged and counted) when it was not: the
        server keeps none, it is too large, or Redis refused."""
        if not self.keeps:
            return False
        doc = kept.model_dump_json(by_alias=True, exclude_none=True)
        if len(doc) > MAX_KEPT_BYTES:
            return self._unkept(response_id, f"{len(doc)} bytes, over {MAX_KEPT_BYTES}")
        try:
            await self.redis.set(self.key(response_id), doc, ex=self.ttl_s)
        except (RedisError, OSError) as e:
            return self._unkept(response_id, repr(e))
        return True

    async def delete(self, response_id: str) -> bool:
        """True if it was kept until now."""
        try:
            return bool(await self.redis.delete(self.key(response_id)))
        except (RedisError, OSError) as e:
            raise ApiError(
                503,
                f"kept responses cannot be deleted: {type(e).__name__}",
                code="redis_unavailable",
            ) from e

    def _unkept(self, response_id: str, why: str) -> bool:
        log.warning("response %s answered but not kept: %s", response_id, why)
        self.metrics.inc("omni_responses_unkept_total")
        return False
