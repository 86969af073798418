"""A conversation cut to a model's context window, as OpenAI Realtime's `truncation: "auto"`
cuts one: the oldest turns go first; the system messages and the turn being answered stay.

Only the engine that refused a prompt knows its size in tokens (llama.cpp counts with the
model's own chat template and tokenizer). So the turns to drop are estimated from that
count, at the prompt's own tokens per character, and the engine is asked again; an
estimate that fell short is refused again with a new count, and cut further.

Cuts fall on every `CUT_STEP`-th message from the conversation's start, not just past
the fewest turns that would do: a conversation that grew by a turn since the last cut
is then cut at the same place, so the engine finds the prompt it ran last time as the
prefix of this one in its cache, instead of reading the whole context again each turn.
"""

from __future__ import annotations

from omni_runtime.stage_api import RequestRefused

MAX_FITS = 4
"""Cuts tried for one request before its last refusal is its error."""
CUT_STEP = 16
"""Messages (8 exchanges) between the places a conversation may be cut at."""


class ContextExceeded(RequestRefused):
    """A prompt longer than the model's context: the request's own fault, failed at once
    with OpenAI's code for it."""

    def __init__(self, prompt_tokens: int, context_tokens: int) -> None:
        super().__init__(
            f"the conversation is {prompt_tokens} tokens, more than the model's context of "
            f"{context_tokens} tokens: send fewer or shorter turns (a Realtime session cuts "
            'its oldest turns itself unless its `truncation` is "disabled")',
            code="context_length_exceeded",
        )
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens


def fit(
    messages: list[dict[str, str]], refused: ContextExceeded, answer_tokens: int
) -> list[dict[str, str]]:
    """`messages` without their oldest turns, enough of them (by estimate) that the prompt
    leaves room for an answer of `answer_tokens` (at most half the context). The leading
    system messages and the last message stay; what is kept starts with a user turn.
    Raises `refused` when nothing is left to drop."""
    head = 0
    while head < len(messages) - 1 and messages[head]["role"] == "system":
        head += 1
    turns = messages[head:-1]
    if not turns:
        raise refused
    tokens_per_char = refused.prompt_tokens / max(1, sum(len(m["content"]) for m in messages))
    context = refused.context_tokens
    excess = refused.prompt_tokens - (context - min(answer_tokens, context // 2))
    dropped, freed = 0, 0.0
    while dropped < len(turns) and (dropped == 0 or freed < excess):
        freed += len(turns[dropped]["content"]) * tokens_per_char
        dropped += 1
    dropped = min(len(turns), -(-dropped // CUT_STEP) * CUT_STEP)
    while dropped < len(turns) and turns[dropped]["role"] != "user":
        dropped += 1
    return [*messages[:head], *turns[dropped:], messages[-1]]
