"""`/v1/conversations`: OpenAI's Conversations API, the conversations a response names
(`conversation` on `POST /v1/responses`) and its clients keep (the Agents SDK's
`OpenAIConversationsSession`).

Create one (with up to 20 items, and metadata), retrieve, update its metadata, delete it;
add items (up to 20 a call), list them (paged as OpenAI's: `order`, `limit`, `after`),
retrieve and delete one. Items are what a response reads: `message`s (text),
`function_call`s and `function_call_output`s, each given an id of its own when added.
Kept in the deployment's Redis (`response_store.ConversationStore`), so every replica of
the server serves the same conversations.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path
from pydantic import Field

from omni_runtime.http.errors import ApiError
from omni_runtime.http.gateway import Gateway
from omni_runtime.http.response_store import (
    MAX_ITEMS_ADDED,
    Held,
    conversation_not_found,
    page,
    shown,
)
from omni_runtime.http.responses import After, Limit, Order, conversations
from omni_runtime.http.responses_request import InputItem, Metadata
from omni_runtime.http.schemas import RequestModel

Items = Annotated[list[InputItem], Field(max_length=MAX_ITEMS_ADDED)]
ConversationId = Annotated[str, Path(min_length=1, max_length=256)]
ItemId = Annotated[str, Path(min_length=1, max_length=256)]


class ConversationCreate(RequestModel):
    items: Items | None = None
    metadata: Metadata | None = None


class ConversationUpdate(RequestModel):
    metadata: Metadata | None


class ItemsCreate(RequestModel):
    items: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS_ADDED)]


def conversations_router(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    async def held(conversation_id: str) -> Held:
        found = await conversations(gateway).get(conversation_id)
        if found is None:
            raise conversation_not_found(conversation_id)
        return found

    @router.post("/conversations", response_model=None)
    async def create(body: ConversationCreate) -> dict[str, Any]:
        made = await conversations(gateway).create(body.metadata or {}, body.items or [])
        return made.model_dump()

    @router.get("/conversations/{conversation_id}", response_model=None)
    async def retrieve(conversation_id: ConversationId) -> dict[str, Any]:
        return (await held(conversation_id)).conversation.model_dump()

    @router.post("/conversations/{conversation_id}", response_model=None)
    async def update(conversation_id: ConversationId, body: ConversationUpdate) -> dict[str, Any]:
        changed = await conversations(gateway).update(conversation_id, body.metadata or {})
        if changed is None:
            raise conversation_not_found(conversation_id)
        return changed.model_dump()

    @router.delete("/conversations/{conversation_id}", response_model=None)
    async def delete(conversation_id: ConversationId) -> dict[str, Any]:
        if not await conversations(gateway).delete(conversation_id):
            raise conversation_not_found(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @router.post("/conversations/{conversation_id}/items", response_model=None)
    async def add(conversation_id: ConversationId, body: ItemsCreate) -> dict[str, Any]:
        added = await conversations(gateway).add(conversation_id, body.items)
        if added is None:
            raise conversation_not_found(conversation_id)
        data = [shown(entry.item, entry.id) for entry in added]
        return {"object": "list", "data": data, "has_more": False,
                "first_id": data[0]["id"], "last_id": data[-1]["id"]}  # fmt: skip

    @router.get("/conversations/{conversation_id}/items", response_model=None)
    async def items(
        conversation_id: ConversationId,
        after: After = None,
        limit: Limit = 20,
        order: Order = "desc",
    ) -> dict[str, Any]:
        found = await held(conversation_id)
        return page(found.shown(), after, limit, order, f"conversation {conversation_id!r}")

    @router.get("/conversations/{conversation_id}/items/{item_id}", response_model=None)
    async def item(conversation_id: ConversationId, item_id: ItemId) -> dict[str, Any]:
        found = await held(conversation_id)
        entry = next((e for e in found.entries if e.id == item_id), None)
        if entry is None:
            raise _item_not_found(item_id)
        return shown(entry.item, entry.id)

    @router.delete("/conversations/{conversation_id}/items/{item_id}", response_model=None)
    async def delete_item(conversation_id: ConversationId, item_id: ItemId) -> dict[str, Any]:
        found = await held(conversation_id)
        if not await conversations(gateway).delete_item(found, item_id):
            raise _item_not_found(item_id)
        return found.conversation.model_dump()

    return router


def _item_not_found(item_id: str) -> ApiError:
    return ApiError(404, f"Item with id '{item_id}' not found.", code="not_found")
