"""What a chat request becomes as stage 0's prompt: its text, its conversation, or its
last message's speech as a spoken turn (decoded and checked: `wav.recording`); each
bounded, and its size estimated for `usage` when the model does not count it."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from omni_runtime.http.errors import ApiError
from omni_runtime.http.gateway import Gateway, Served
from omni_runtime.http.schemas import ChatCompletionRequest
from omni_runtime.wav import WavError, recording


def check_prompt(gateway: Gateway, prompt: str, param: str) -> None:
    if not prompt.strip():
        raise ApiError(400, "the prompt is empty", param=param, code="empty_prompt")
    if len(prompt) > gateway.serve.max_prompt_chars:
        raise ApiError(
            400,
            f"the prompt exceeds {gateway.serve.max_prompt_chars} characters",
            param=param,
            code="prompt_too_long",
        )


def unsupported(served: Served, what: str) -> ApiError:
    """A request the model named cannot serve (its pipeline lacks the input or output)."""
    return ApiError(
        400, f"the model {served.name!r} {what}", param="model", code="unsupported_model"
    )


TOKEN = re.compile(r"\w+|[^\w\s]")


def count_tokens(prompt: Any) -> int:
    """`usage.prompt_tokens`: the words and punctuation marks of what stage 0 is given (all
    the messages of a chat), as `completion_tokens` counts the text pieces it answers
    with. The front door has no model's tokenizer: a thinker's own count may differ."""
    if isinstance(prompt, dict):
        return sum(count_tokens(m["content"]) for m in prompt.get("messages", ()))
    return len(TOKEN.findall(str(prompt)))


def chat_prompt(gateway: Gateway, served: Served, req: ChatCompletionRequest) -> Any:
    """The conversation for a pipeline taking chat messages, the last user message for one
    taking text; for one that hears, what `heard_prompt` makes."""
    if served.outputs.input == "audio":
        return heard_prompt(gateway, served, req)
    if any(m.audio() for m in req.messages):
        raise unsupported(served, "takes text, not audio (a model whose pipeline hears does)")
    check_prompt(gateway, req.prompt, "messages")
    if served.outputs.input == "text":
        return req.prompt
    return {"messages": _conversation(gateway, req)}


def _conversation(gateway: Gateway, req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as a text stage reads them, checked."""
    try:
        messages: list[dict[str, str]] = req.conversation()["messages"]
    except ValueError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_value") from None
    check_prompt(gateway, "".join(m["content"] for m in messages), "messages")
    return messages


def heard_prompt(gateway: Gateway, served: Served, req: ChatCompletionRequest) -> Any:
    """The last user message's speech (one `input_audio` file: WAV, MP3, FLAC or Ogg) as a spoken turn, with the
    messages before it (and its own text, as a user message before the speech) and those
    after it (the assistant's tool calls, their results: `after`, read after what was
    heard): what `/v1/realtime` sends such a pipeline. Earlier turns are text: none is
    heard again."""
    last = max(i for i, m in enumerate(req.messages) if m.role == "user")
    param = f"messages.{last}.content"
    spoken = [i for i, m in enumerate(req.messages) if m.audio()]
    if not spoken and served.outputs.text_turns:  # typed: nothing to hear (`text_turns`)
        return {"wav": None, "messages": _conversation(gateway, req)}
    if last not in spoken:
        raise ApiError(400, f"the model {served.name!r} takes speech: send it in the last user "
                       "message as an input_audio part (a WAV or MP3 file), or to "
                       "/v1/audio/transcriptions", param=param)  # fmt: skip
    if spoken != [last]:
        raise ApiError(400, "only the last user message may carry audio: send earlier turns "
                       "as text", param=f"messages.{spoken[0]}.content")  # fmt: skip
    parts = req.messages[last].audio()
    if len(parts) > 1:
        raise ApiError(400, "a message carries one input_audio part", param=param)
    try:
        wav = recording(base64.b64decode(parts[0].data, validate=True))
    except (binascii.Error, WavError) as e:
        why = e if isinstance(e, WavError) else "not base64"
        raise ApiError(400, f"input_audio: {why}", param=param, code="invalid_audio") from None
    try:
        whole = req.conversation()["messages"]
    except ValueError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_value") from None
    history = [m for m in whole[: last + 1] if m["content"].strip()]
    after = [m for m in whole[last + 1 :] if m["content"].strip()]
    if history or after:
        check_prompt(gateway, "".join(m["content"] for m in history + after), "messages")
    turn: dict[str, Any] = {"wav": wav}
    return turn | ({"messages": history} if history else {}) | ({"after": after} if after else {})
