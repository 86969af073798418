"""A speech-in pipeline's forward function: the transcript joins the conversation.

`workers/listen.yaml` hears a spoken turn (stage 0, speech to text) and answers it
(stage 1, the thinker). A front end holding a conversation (`/v1/realtime`) sends
`{"wav": ..., "messages": [...]}`: the thinker then gets those messages with the
transcript as the last user turn, so it answers in context. Without `messages`, the
thinker gets the transcript alone, as the default forward gives it. Sequential mode
only: in streaming mode stages read their upstream's chunks and no forward runs.
"""

from __future__ import annotations

from typing import Any

from omni_runtime.engines.llama_cpp import upstream_text


def forward(next_stage_id: int, prompt: Any, previous: list[Any]) -> Any:
    """`forward_fn(next_stage_id, prompt, previous_stage_data)` (see `pipeline.forward`)."""
    history = prompt.get("messages") if isinstance(prompt, dict) else None
    if next_stage_id != 1 or not isinstance(history, list) or not history:
        return previous
    return {"messages": [*history, {"role": "user", "content": upstream_text(previous)}]}
