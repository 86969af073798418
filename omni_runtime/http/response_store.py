"""What the Responses API keeps: responses (`store`), for `previous_response_id` and
`GET /v1/responses/{id}`, and conversations (`/v1/conversations`, `conversation`).

Each is kept in the deployment's Redis under its id, with a TTL (`OMNI_RESPONSES_TTL_S`),
so any replica of the server continues a conversation another one began, and a server
restarted goes on with them (not one that started a private Redis of its own, which
goes with it). A kept response holds the body it was answered with and its
conversation as input items: the items of the responses before it, its own input, then
its output as an assistant's turn. So a response that follows it is one read, whatever
the length of the chain; `instructions` are not among them (OpenAI's rule: each response
gives its own). What Redis hands back is validated as a request's input is.

A conversation is one Redis list (`Names.conversation`): its object first, then its
items, oldest first, each with its id. One key, so a cluster keeps it in one slot and
every change is one command: `RPUSHX` appends a response's turn whole, or nothing to a
conversation deleted meanwhile; `LSET` its metadata; `LREM` an item. Its TTL
(`OMNI_CONVERSATIONS_TTL_S`) counts from its last use. Two responses on one conversation
at once each read it as it was when they began, and each appends its turn when it ends
(OpenAI refuses the second instead, `conversation_locked`; nothing here is locked, so a
server that dies mid-answer leaves no lock behind).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from omni_runtime.http.errors import ApiError, out_of_memory
from omni_runtime.http.responses_request import (
    FunctionCallItem,
    InputItem,
    MessageItem,
    Metadata,
)
from omni_runtime.http.schemas import MAX_MESSAGES
from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io.refusals import is_oom, oom_message

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
    events: bool = False
    """Its events are kept to be read again (`background` and `stream`: `background.py`)."""

    def input_items(self, response_id: str) -> list[dict[str, Any]]:
        """Its input items, oldest first, as `GET /v1/responses/{id}/input_items` lists
        them: each with an id of its own (`<kind>_<response>_<index>`)."""
        given, suffix = self.history[: self.inputs], response_id.removeprefix("resp_")
        return [shown(item, item_id(item, f"{suffix}_{k}")) for k, item in enumerate(given)]


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


def item_id(item: InputItem, suffix: str) -> str:
    """An item's id: its kind's prefix (OpenAI's) and `suffix`."""
    kind = {"function_call": "fc", "function_call_output": "fco"}.get(item.type, "msg")
    return f"{kind}_{suffix}"


def shown(item: InputItem, its_id: str) -> dict[str, Any]:
    """An input item as OpenAI's lists show it: with its id and status, and an earlier
    answer's text as output text."""
    if isinstance(item, FunctionCallItem):
        return {"id": its_id, "type": "function_call", "status": "completed",
                "call_id": item.call_id, "name": item.name, "arguments": item.arguments}  # fmt: skip
    if isinstance(item, MessageItem):
        part: dict[str, Any] = {"type": "input_text", "text": item.text()}
        if item.role == "assistant":
            part = {"type": "output_text", "text": item.text(), "annotations": []}
        return {"id": its_id, "type": "message", "status": "completed",
                "role": item.role, "content": [part]}  # fmt: skip
    return {"id": its_id, "type": "function_call_output", "status": "completed",
            "call_id": item.call_id, "output": item.output}  # fmt: skip


def page(
    items: list[dict[str, Any]], after: str | None, limit: int, order: str, where: str
) -> dict[str, Any]:
    """One page of a list of items (oldest first), as OpenAI pages them: newest first
    unless `order` is `asc`, from the item after `after`; a 400 if `after` is not in it."""
    items = items[::-1] if order == "desc" else items
    if after is not None:
        at = next((k for k, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise ApiError(400, f"no item {after!r} in {where}", param="after",
                           code="invalid_value")  # fmt: skip
        items = items[at + 1 :]
    data = items[:limit]
    return {"object": "list", "data": data, "has_more": len(items) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}  # fmt: skip


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
            raise unavailable("kept responses cannot be read", e) from e
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
            raise unavailable("kept responses cannot be deleted", e) from e

    def _unkept(self, response_id: str, why: str) -> bool:
        log.warning("response %s answered but not kept: %s", response_id, why)
        self.metrics.inc("omni_responses_unkept_total")
        return False


def unavailable(what: str, e: BaseException) -> ApiError:
    """A 503 for a Redis call that failed: out of memory (retry later), or unreachable."""
    if is_oom(e):
        return out_of_memory(f"{what}: {oom_message(e)}")
    return ApiError(503, f"{what}: {type(e).__name__}", code="redis_unavailable")


def conversation_not_found(conversation_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Conversation with id '{conversation_id}' not found.", param=param,
                    code="not_found")  # fmt: skip


MAX_ITEMS_ADDED = 20
"""Items one call may add to a conversation (OpenAI's limit)."""


class Conversation(BaseModel):
    """A conversation's object, as kept and as shown."""

    id: str
    object: str = "conversation"
    created_at: int
    metadata: Metadata


class Entry(BaseModel):
    """A conversation's item as kept: its id, and the item."""

    id: str
    item: InputItem


@dataclass
class Held:
    """A conversation as read: its object, and its items, oldest first, each as Redis
    holds it (`LREM` names one by its value) and as read."""

    conversation: Conversation
    raw: list[bytes]
    entries: list[Entry]

    def history(self) -> list[InputItem]:
        return [entry.item for entry in self.entries]

    def shown(self) -> list[dict[str, Any]]:
        return [shown(entry.item, entry.id) for entry in self.entries]

    def size(self) -> int:
        return sum(len(raw) for raw in self.raw)


class ConversationStore:
    def __init__(
        self, redis: Redis, key: Callable[[str], str], ttl_s: int, metrics: Metrics
    ) -> None:
        """`key`: a conversation id's Redis name (`Names.conversation`)."""
        self.redis, self.key, self.ttl_s, self.metrics = redis, key, ttl_s, metrics

    async def create(self, metadata: dict[str, str], items: list[InputItem]) -> Conversation:
        conversation = Conversation(
            id=f"conv_{secrets.token_hex(24)}", created_at=int(time.time()), metadata=metadata
        )
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                values = _values(entries_of(items))
                pipe.rpush(self.key(conversation.id), conversation.model_dump_json(), *values)
                pipe.expire(self.key(conversation.id), self.ttl_s)
                await pipe.execute()
        except (RedisError, OSError) as e:
            raise unavailable("the conversation cannot be kept", e) from e
        return conversation

    async def get(self, conversation_id: str) -> Held | None:
        """The conversation, or None (never made, expired, deleted; or its object is
        unreadable, which is logged); an unreadable item is left out, logged and counted.
        Reading it counts as its use (its TTL begins again)."""
        key = self.key(conversation_id)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.lrange(key, 0, -1)
                pipe.expire(key, self.ttl_s)
                raw, _ = await pipe.execute()
        except (RedisError, OSError) as e:
            raise unavailable("conversations cannot be read", e) from e
        if not raw:
            return None
        try:
            conversation = Conversation.model_validate_json(raw[0])
        except ValidationError as e:
            self._unreadable(f"conversation {conversation_id}", e)
            return None
        held = Held(conversation, [], [])
        for value in raw[1:]:
            try:
                held.entries.append(Entry.model_validate_json(value))
                held.raw.append(value)
            except ValidationError as e:
                self._unreadable(f"an item of conversation {conversation_id}", e)
        return held

    async def update(self, conversation_id: str, metadata: dict[str, str]) -> Conversation | None:
        held = await self.get(conversation_id)
        if held is None:
            return None
        conversation = held.conversation.model_copy(update={"metadata": metadata})
        try:
            await self.redis.lset(self.key(conversation_id), 0, conversation.model_dump_json())
        except ResponseError as e:
            if "no such key" in str(e).lower():  # deleted meanwhile
                return None
            raise unavailable("the conversation cannot be changed", e) from e
        except (RedisError, OSError) as e:
            raise unavailable("the conversation cannot be changed", e) from e
        return conversation

    async def add(self, conversation_id: str, items: list[InputItem]) -> list[Entry] | None:
        """Append `items` whole, after the conversation's; None if there is no conversation
        (deleted meanwhile: nothing is added); a 400 if it would grow past its bounds."""
        held = await self.get(conversation_id)
        if held is None:
            return None
        entries = entries_of(items)
        values = _values(entries)
        count, size = len(held.entries) + len(values), held.size() + sum(map(len, values))
        if count > MAX_MESSAGES or size > MAX_KEPT_BYTES:
            raise ApiError(
                400,
                f"conversation {conversation_id!r} would hold {count} items of {size} bytes, "
                f"over its bounds ({MAX_MESSAGES} items, {MAX_KEPT_BYTES} bytes): begin another",
                param="conversation",
                code="invalid_value",
            )
        key = self.key(conversation_id)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.rpushx(key, *values)
                pipe.expire(key, self.ttl_s)
                length, _ = await pipe.execute()
        except (RedisError, OSError) as e:
            raise unavailable("the conversation cannot be added to", e) from e
        return entries if length else None

    async def delete(self, conversation_id: str) -> bool:
        """True if it was there until now."""
        try:
            return bool(await self.redis.delete(self.key(conversation_id)))
        except (RedisError, OSError) as e:
            raise unavailable("the conversation cannot be deleted", e) from e

    async def delete_item(self, held: Held, wanted: str) -> bool:
        """True if the item `wanted` was in the conversation until now."""
        at = next((k for k, e in enumerate(held.entries) if e.id == wanted), None)
        if at is None:
            return False
        try:
            return bool(
                await self.redis.lrem(self.key(held.conversation.id), 1, held.raw[at].decode())
            )
        except (RedisError, OSError) as e:
            raise unavailable("the item cannot be deleted", e) from e

    def _unreadable(self, what: str, e: ValidationError) -> None:
        log.warning("%s is unreadable, left out: %s", what, e)
        self.metrics.inc("omni_malformed_entries_total", stream="kept conversations")


def entries_of(items: list[InputItem]) -> list[Entry]:
    """Items to add, each with an id of its own."""
    return [Entry(id=item_id(item, secrets.token_hex(24)), item=item) for item in items]


def _values(entries: list[Entry]) -> list[str]:
    return [entry.model_dump_json(exclude_none=True) for entry in entries]
