"""A spoken turn in a conversation: the transcript joins the messages sent with it.

`workers/listen.yaml` hears a spoken turn (stage 0, speech to text) and answers it
(stage 1, the thinker). A front end holding a conversation (`/v1/realtime`) sends
`{"wav": ..., "messages": [...]}`: the thinker then gets those messages with the
transcript as the last user turn, so it answers in context; without `messages`, the
transcript alone. `"after": [...]` are messages that came after the spoken turn (the
assistant's tool calls, their results): read after the transcript. `"wav": None` is a
turn with nothing to hear (the answer to a tool's result): the speech-to-text stage
hears nothing, and the thinker reads the messages alone. The same rule in both modes:
in sequential mode `forward` (listen.yaml's `forward:`) builds the thinker's input; in
streaming mode no forward runs, and the thinker (`llama_cpp.LlamaCppEngine`) applies
`heard_turn` to its upstream's `ChunkStream`, which carries the request's prompt.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def upstream_text(chunks: Iterable[Any]) -> str:
    """A previous stage's text chunks as one user turn (a ChunkStream blocks till it ends)."""
    return "".join(str(c) for c in chunks if c).strip()


def unspoken(prompt: Any) -> bool:
    """A turn with nothing to hear: `{"wav": None, "messages": [...]}` (messages given)."""
    if not isinstance(prompt, dict) or "wav" not in prompt or prompt["wav"] is not None:
        return False
    return isinstance(prompt.get("messages"), list) and bool(prompt["messages"])


def heard_turn(prompt: Any, transcript: str) -> Any:
    """The thinker's input for a spoken turn: the prompt's `messages`, the transcript (none
    for an unspoken turn), then the messages `after` it."""
    if not isinstance(prompt, dict):
        return transcript
    history, after = prompt.get("messages"), prompt.get("after")
    history = history if isinstance(history, list) else []
    after = after if isinstance(after, list) else []
    if unspoken(prompt):
        return {"messages": [*history, *after]}
    if not history and not after:
        return transcript
    return {"messages": [*history, {"role": "user", "content": transcript}, *after]}


def forward(next_stage_id: int, prompt: Any, previous: list[Any]) -> Any:
    """`forward_fn(next_stage_id, prompt, previous_stage_data)` (see `pipeline.forward`)."""
    return heard_turn(prompt, upstream_text(previous)) if next_stage_id == 1 else previous
