"""A Realtime session's conversation as the client shapes it: items put where it says,
read back, deleted, an answer's audio truncated; and what the thinker then reads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from omni_runtime.core.tool_calls import written_result
from omni_runtime.http.realtime_conversation import MAX_ITEMS, Conversation
from omni_runtime.http.realtime_events import EventError, parse_client_event
from omni_runtime.http.realtime_response import Item


def conversation() -> tuple[Conversation, list[dict[str, Any]]]:
    said: list[dict[str, Any]] = []
    return Conversation(said.append, max_prompt_chars=10_000), said


def answer(item_id: str, text: str, modalities: tuple[str, ...], audio_ms: float) -> Item:
    return Item(item_id, "assistant", text, modalities=modalities, audio_ms=audio_ms)


def test_items_go_where_the_client_puts_them() -> None:
    talk, said = conversation()
    talk.add(Item("a", "user", "first"))
    talk.add(Item("c", "user", "third"))
    talk.add(Item("b", "user", "second"), previous_id="a")
    talk.add(Item("z", "system", "zeroth"), previous_id="root")
    assert [i.id for i in talk.items] == ["z", "a", "b", "c"]
    added = [(e["item"]["id"], e["previous_item_id"]) for e in said if e["type"].endswith("added")]
    assert added == [("a", None), ("c", "a"), ("b", "a"), ("z", None)]
    with pytest.raises(EventError) as missing:
        talk.add(Item("x", "user", "lost"), previous_id="nope")
    assert (missing.value.code, missing.value.param) == ("item_not_found", "previous_item_id")
    with pytest.raises(EventError) as taken:
        talk.add(Item("b", "user", "again"))
    assert (taken.value.code, taken.value.param) == ("item_id_taken", "item.id")
    assert [i.id for i in talk.items] == ["z", "a", "b", "c"]
    assert [m["content"] for m in talk.messages("")] == ["zeroth", "first", "second", "third"]


def test_only_the_latest_spoken_item_waits_to_be_heard() -> None:
    talk, _said = conversation()
    talk.add(Item("a", "user", kind="audio", audio=b"\0\0"))
    talk.add(Item("b", "user", kind="audio", audio=b"\1\1"))
    assert [i.audio for i in talk.items] == [None, b"\1\1"]


def test_an_item_is_read_back_and_deleted() -> None:
    talk, said = conversation()
    talk.add(Item("a", "user", "keep me"))
    talk.add(Item("b", "user", "forget me"))
    talk.retrieve("b")
    assert said[-1]["type"] == "conversation.item.retrieved"
    assert said[-1]["item"]["content"] == [{"type": "input_text", "text": "forget me"}]
    talk.delete("b")
    assert said[-1] | {"event_id": None} == {
        "type": "conversation.item.deleted", "item_id": "b", "event_id": None
    }  # fmt: skip
    assert [m["content"] for m in talk.messages("")] == ["keep me"]
    for gone in (talk.retrieve, talk.delete):
        with pytest.raises(EventError) as missing:
            gone("b")
        assert missing.value.code == "item_not_found"


def test_a_truncated_answer_keeps_the_words_the_user_heard() -> None:
    talk, said = conversation()
    talk.add(Item("q", "user", "Tell me a story."))
    spoken = answer("s", "Once upon a time there was a fox.", ("text", "audio"), 2400.2)
    spoken.speaks_all = True
    talk.join([spoken])
    item = talk.truncatable("s", content_index=1, audio_end_ms=2401)  # the last ms, rounded up
    talk.truncate(item, 1, 900)
    assert said[-1]["type"] == "conversation.item.truncated"
    assert (said[-1]["item_id"], said[-1]["content_index"], said[-1]["audio_end_ms"]) == (
        "s", 1, 900
    )  # fmt: skip
    # 900 of 2400 ms: 37.5 % of its 33 letters is 12.4, and "a" ends at the 11th
    assert spoken.text == "Once upon a" and spoken.audio_ms == 900
    assert talk.messages("") == [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a"},
    ]
    assert spoken.as_dict()["content"] == [
        {"type": "output_text", "text": "Once upon a"},
        {"type": "output_audio", "transcript": "Once upon a"},
    ]


@pytest.mark.parametrize(
    ("speaks_all", "end_ms", "kept"),
    [
        (True, 1000, "Once upon a time there was a fox."),  # heard to its end
        (True, 10, ""),  # not one word
        (False, 900, ""),  # still being made, or cut short: its text ran ahead of its audio
    ],
)
def test_a_truncated_answer_keeps_no_word_the_user_may_not_have_heard(
    speaks_all: bool, end_ms: int, kept: str
) -> None:
    talk, _said = conversation()
    spoken = answer("s", "Once upon a time there was a fox.", ("audio",), 1000)
    spoken.speaks_all = speaks_all
    talk.join([spoken])
    talk.truncate(talk.truncatable("s", 0, end_ms), 0, end_ms)
    assert spoken.text == kept and spoken.audio_ms == end_ms


def test_what_cannot_be_truncated_is_refused_and_left_as_it_was() -> None:
    talk, _said = conversation()
    talk.add(Item("q", "user", "Hi"))
    talk.join([answer("t", "Hello.", ("text",), 0), answer("s", "Hello.", ("audio",), 500)])
    refusals = [
        (("q", 0, 0), "item_id"),  # the user's
        (("t", 0, 0), "item_id"),  # no audio
        (("s", 1, 100), "content_index"),  # its audio is part 0
        (("s", 0, 501), "audio_end_ms"),  # past the audio sent
        (("x", 0, 0), "item_id"),
    ]
    for (item_id, index, end_ms), param in refusals:
        with pytest.raises(EventError) as refused:
            talk.truncatable(item_id, index, end_ms)
        assert refused.value.param == param, (item_id, str(refused.value))
    assert [i.text for i in talk.items] == ["Hi", "Hello.", "Hello."]


def test_the_oldest_items_go_past_the_cap() -> None:
    talk, _said = conversation()
    for k in range(MAX_ITEMS + 5):
        talk.add(Item(f"i{k}", "user", f"turn {k}"))
    assert len(talk.items) == MAX_ITEMS and talk.items[0].id == "i5"


def test_a_response_reads_a_context_of_its_own() -> None:
    talk, _said = conversation()
    talk.add(Item("a", "user", kind="audio", audio=b"\0\0"))
    given: Any = parse_client_event(json.dumps({"type": "response.create", "response": {"input": [
        {"type": "item_reference", "id": "a"},
        {"type": "function_call", "call_id": "c1", "name": "clock", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "noon"},
    ]}}))  # fmt: skip
    context = talk.context(given.response.input, "audio/pcm")
    assert [i.kind for i in context.items] == ["audio", "function_call", "function_call_output"]
    assert context.items[2].text == written_result("clock", "noon")  # the call, named
    context.items[0].text, context.items[0].audio = "heard", None  # a response heard it
    assert (talk.items[0].text, talk.items[0].audio) == ("", b"\0\0")  # not the conversation's
    missing: Any = parse_client_event(json.dumps({"type": "response.create", "response": {
        "input": [{"type": "item_reference", "id": "gone"}]}}))  # fmt: skip
    with pytest.raises(EventError) as refused:
        talk.context(missing.response.input, "audio/pcm")
    assert (refused.value.code, refused.value.param) == ("item_not_found", "response.input.0.id")
