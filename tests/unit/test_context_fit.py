"""Cutting a conversation to a model's context (`engines/context_fit.py`): no model here,
the refusals are made up with the counts llama.cpp's would carry."""

from __future__ import annotations

import pytest

from omni_runtime.engines.context_fit import CUT_STEP, ContextExceeded, fit


def chat(exchanges: int, system: bool = True) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    for i in range(exchanges):
        messages += [
            {"role": "user", "content": f"question {i:03d} " + "x" * 30},
            {"role": "assistant", "content": f"answer {i:03d} " + "y" * 30},
        ]
    return [*messages, {"role": "user", "content": "the question now"}]


def tokens(messages: list[dict[str, str]]) -> int:
    """A stand-in for the model's count: one token per 4 characters."""
    return sum(len(m["content"]) for m in messages) // 4


def test_the_oldest_turns_go_and_the_system_message_and_the_question_stay() -> None:
    messages = chat(40)
    kept = fit(messages, ContextExceeded(tokens(messages), 256), answer_tokens=64)
    assert kept[0] == messages[0] and kept[-1] == messages[-1]
    assert kept[1]["role"] == "user"
    assert kept[1:-1] == messages[len(messages) - len(kept) + 1 : -1]  # the newest turns, whole
    assert tokens(kept) <= 256 - 64


def test_a_conversation_one_exchange_longer_is_cut_at_the_same_place() -> None:
    """So the engine finds the last prompt it ran as this one's prefix in its cache."""
    cuts = []
    for exchanges in range(40, 40 + CUT_STEP // 2):
        messages = chat(exchanges)
        kept = fit(messages, ContextExceeded(tokens(messages), 512), answer_tokens=64)
        cuts.append(kept[1]["content"])
    assert len(set(cuts)) <= 2, cuts  # one step, at most, over CUT_STEP / 2 exchanges


def test_a_cut_that_falls_short_is_cut_further_on_the_next_refusal() -> None:
    messages = chat(40)
    once = fit(messages, ContextExceeded(tokens(messages), 1000), answer_tokens=64)
    again = fit(once, ContextExceeded(tokens(once) * 4, 1000), answer_tokens=64)
    assert len(again) < len(once)


def test_with_nothing_left_to_drop_the_refusal_stands() -> None:
    refused = ContextExceeded(5000, 1024)
    with pytest.raises(ContextExceeded) as raised:
        fit([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], refused, 64)
    assert raised.value is refused
    assert "5000 tokens, more than the model's context of 1024 tokens" in str(refused)
    at_most = fit(chat(3, system=False), ContextExceeded(100_000, 1024), 64)
    assert at_most == [chat(0, system=False)[-1]]
