"""A Realtime session's conversation: its items in order, as the client shapes it, and the
messages the thinker reads of it.

A client adds items where it says (`previous_item_id`: after that item, `root` first, none
last), reads one back (`conversation.item.retrieve`), deletes one, or truncates the audio
of an answer the user did not hear to its end (`conversation.item.truncate`, sent on an
interruption by OpenAI's clients). The conversation then holds no words the user did not
hear: OpenAI deletes the answer's transcript and its model hears the audio played; the
thinker here reads text, so the answer keeps the words heard (estimated, `words_heard`),
or none if it was still being made. A response may read a context of its own
instead (`response.input`: items given whole, and the conversation's by reference).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from omni_runtime.core.tool_calls import ToolCall
from omni_runtime.http.realtime_audio import AudioType, InputDecoder
from omni_runtime.http.realtime_events import (
    CallItem,
    CallOutputItem,
    ClientItem,
    ContextItem,
    EventError,
    ItemReference,
    decode_audio,
    event,
    new_id,
)
from omni_runtime.http.realtime_response import Item

MAX_ITEMS = 200
"""Conversation items a session keeps (oldest dropped): the thinker takes 256 messages."""
ROOT = "root"
"""`previous_item_id` of an item put first."""


class Conversation:
    """The items, oldest first; each change is said to the client through `emit`."""

    def __init__(self, emit: Callable[[Any], None], max_prompt_chars: int) -> None:
        self.emit, self.max_prompt_chars = emit, max_prompt_chars
        self.items: list[Item] = []

    @property
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def add(self, item: Item, previous_id: str | None = None) -> None:
        """Put `item` after the item `previous_id` (`root`: first; None: last), and say it.
        A spoken item is the one the next response hears: older ones are not heard. An id
        the conversation holds already is refused: retrieve, delete and truncate name one."""
        if any(old.id == item.id for old in self.items):
            raise EventError(f"the conversation already has an item {item.id!r}",
                             code="item_id_taken", param="item.id")  # fmt: skip
        at = self._after(previous_id)
        if item.audio is not None:
            for old in self.items:
                old.audio = None
        self.items.insert(at, item)
        previous = self.items[at - 1].id if at else None
        self._trim()
        for state in ("added", "done"):
            self.emit(event(f"conversation.item.{state}", previous_item_id=previous,
                            item=item.as_dict()))  # fmt: skip

    def join(self, items: list[Item]) -> None:
        """A response's own items, at the end (its events say them)."""
        self.items += items
        self._trim()

    def find(self, item_id: str) -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise EventError(f"no item {item_id!r} in the conversation", code="item_not_found",
                         param="item_id")  # fmt: skip

    def retrieve(self, item_id: str) -> None:
        self.emit(event("conversation.item.retrieved", item=self.find(item_id).as_dict()))

    def delete(self, item_id: str) -> None:
        self.items.remove(self.find(item_id))
        self.emit(event("conversation.item.deleted", item_id=item_id))

    def truncatable(self, item_id: str, content_index: int, audio_end_ms: int) -> Item:
        """The assistant's item whose audio part `content_index` lasted at least
        `audio_end_ms`; else the EventError that says why not."""
        item = self.find(item_id)
        if item.role != "assistant" or item.kind != "text" or "audio" not in item.modalities:
            raise EventError("only an assistant's message with audio can be truncated",
                             param="item_id")  # fmt: skip
        audio_at = 1 if "text" in item.modalities else 0
        if content_index != audio_at:
            raise EventError(f"part {content_index} of item {item_id!r} is not its audio "
                             f"(part {audio_at})", param="content_index")  # fmt: skip
        sent_ms = math.ceil(item.audio_ms)
        if audio_end_ms > sent_ms:
            raise EventError(f"audio_end_ms {audio_end_ms} is past the end of the item's "
                             f"audio, {sent_ms} ms", param="audio_end_ms")  # fmt: skip
        return item

    def truncate(self, item: Item, content_index: int, audio_end_ms: int) -> None:
        """Its audio ends at `audio_end_ms` (`truncatable` first), and it keeps the words the
        user heard. Those are known only of an answer whose audio says all its text (its
        response ran to its end): they are estimated from the share of the audio played.
        Of an answer still being made, or cut short, the text ran ahead of the audio: none
        are kept, as on OpenAI (a response still running is cancelled first)."""
        share = audio_end_ms / item.audio_ms if item.audio_ms > 0 else 0.0
        heard = words_heard(item.text, share) if item.speaks_all else ""
        item.text, item.audio_ms = heard, float(audio_end_ms)
        self.emit(event("conversation.item.truncated", item_id=item.id,
                        content_index=content_index, audio_end_ms=audio_end_ms))  # fmt: skip

    def messages(
        self, instructions: str, before: Item | None = None, after: Item | None = None
    ) -> list[dict[str, str]]:
        """The text of the items `before` or `after` one (else all), the latest that fit."""
        messages: list[dict[str, str]] = []
        used = len(instructions)
        items = self.items[self.items.index(after) + 1 :] if after else self.items
        for item in reversed(items[: items.index(before)] if before else items):
            if not item.text.strip():
                continue
            used += len(item.text)
            if used > self.max_prompt_chars:
                break
            messages.append({"role": item.role, "content": item.text})
        messages.reverse()
        if instructions.strip():
            messages.insert(0, {"role": "system", "content": instructions})
        return messages

    def context(self, given: list[ContextItem], input_format: AudioType) -> Conversation:
        """A response's own context (`response.input`): the items given, and copies of
        this conversation's it names (hearing one does not hear this one's)."""
        context = Conversation(lambda _event: None, self.max_prompt_chars)
        for i, item in enumerate(given):
            where = f"response.input.{i}"
            if isinstance(item, ItemReference):
                named = next((it for it in self.items if it.id == item.id), None)
                if named is None:
                    raise EventError(f"no item {item.id!r} in the conversation",
                                     code="item_not_found", param=f"{where}.id")  # fmt: skip
                context.join([replace(named)])
            else:
                earlier = [*self.items, *context.items]
                context.join([item_of(item, earlier, input_format, where)])
        return context

    def _after(self, previous_id: str | None) -> int:
        """Where an item put after `previous_id` goes."""
        if previous_id is None:
            return len(self.items)
        if previous_id == ROOT:
            return 0
        for at, item in enumerate(self.items):
            if item.id == previous_id:
                return at + 1
        raise EventError(f"no item {previous_id!r} in the conversation to put the item after",
                         code="item_not_found", param="previous_item_id")  # fmt: skip

    def _trim(self) -> None:
        del self.items[:-MAX_ITEMS]


def words_heard(text: str, share: float) -> str:
    """The words of `text` said within the first `share` of its audio: speech lasts about
    in proportion to its letters, so a word is kept if it ends within that share of the
    text (how close that is: `docs/realtime.md`)."""
    if share >= 1.0:
        return text
    spoken = share * len(text)
    ends = [m.end() for m in re.finditer(r"\S+", text) if m.end() <= spoken]
    return text[: ends[-1]] if ends else ""


def item_of(given: ClientItem, earlier: list[Item], input_format: AudioType, where: str) -> Item:
    """The item a client gives (`where` it is given, for errors), as a conversation keeps
    it; `earlier`: the items a call's output may answer."""
    if isinstance(given, CallItem):
        made = ToolCall(given.name, given.arguments)
        return Item.call(given.id or new_id("item"), given.call_id, made)
    if isinstance(given, CallOutputItem):
        name = next((i.name for i in earlier if i.call_id == given.call_id
                     and i.kind == "function_call"), None)  # fmt: skip
        return Item.result(given.id or new_id("item"), given.call_id, name, given.output)
    texts: list[str] = []
    audio = bytearray()
    for i, part in enumerate(given.content):
        if part.type == "input_audio":
            if part.audio:
                decode = InputDecoder(input_format)  # a whole recording of its own
                audio += decode_audio(part.audio, f"{where}.content.{i}.audio", decode)
            if part.transcript:
                texts.append(part.transcript)
        else:
            texts.append(part.text or part.transcript or "")
    kind: Literal["text", "audio"] = "audio" if audio else "text"
    item = Item(given.id or new_id("item"), given.role, " ".join(t for t in texts if t),
                bytes(audio) or None, kind)  # fmt: skip
    if kind == "text" and not item.text.strip():
        raise EventError("the item has no text and no audio", param=f"{where}.content")
    return item
