"""Function calling on the real thinker: what offering tools costs a spoken answer, how
soon a required call comes, and how well the model chooses.

`omni-runtime serve` fronting workers/voice.yaml (SmolLM2 on llama.cpp), as a user runs
it (embedded), the official client, c = 1, streamed chats without audio:

* text: questions no tool answers, asked with two tools offered (`auto`) and without,
  alternately, the same seed: time to the first piece of text and to the end. Baseline:
  without tools. No target: what offering tools costs is the answer's JSON opening,
  written before its text, and the grammar's check of each token.
* calls: questions a tool answers, asked with the call `required`: time to the first
  call (its delta: each call is sent when its object closes), and the share of calls
  whose arguments parse as their function's parameters (target: all; the grammar holds
  them).
* choice: every question with `auto`: the share the model answered as it should
  (a call for a tool's question, text for the others); reported, no target (the small
  model's judgement, not the runtime's).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import openai

from benchmarks.harness import scenario
from benchmarks.harness.report import ROOT, Row, ratio
from benchmarks.harness.serve import ServeProcess
from benchmarks.harness.stats import percentile

PIPELINE = str(ROOT / "workers" / "voice.yaml")
TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                       "b": {"type": "number"}}, "required": ["a", "b"],
                       "additionalProperties": False}}},
]  # fmt: skip
ARGUMENTS = {"get_weather": {"city"}, "add": {"a", "b"}}
PLAIN = [
    "Hello! Who are you?", "Tell me a joke.", "Why is the sky blue?", "What do bees make?",
    "Describe a rainy morning.", "What is a volcano?", "Write a haiku about rain.",
    "Why do cats purr?",
]  # fmt: skip
CALLED = [
    ("What's the weather in Paris right now?", "get_weather"),
    ("Is it raining in London?", "get_weather"), ("What is 17 plus 25?", "add"),
    ("Add 3 and 4.", "add"), ("How warm is it in Tokyo today?", "get_weather"),
    ("What is 1.5 plus 2.25?", "add"),
]  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    rounds: int
    max_tokens: int = 96


FULL = Sizes(rounds=3)
QUICK = Sizes(rounds=1)


@dataclass
class Answer:
    first_s: float | None = None
    """The first text, or the call, from the question."""
    end_s: float = 0.0
    text: str = ""
    calls: list[tuple[str, str]] | None = None


async def ask(
    llm: openai.AsyncOpenAI, question: str, seed: int, max_tokens: int, **tools: Any
) -> Answer:
    out, t0 = Answer(), time.monotonic()
    stream = await llm.chat.completions.create(
        model="voice", messages=[{"role": "user", "content": question}], stream=True,
        max_tokens=max_tokens, seed=seed, **tools,
    )  # fmt: skip
    async for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        if delta.content or delta.tool_calls:
            out.first_s = out.first_s or time.monotonic() - t0
        out.text += delta.content or ""
        for call in delta.tool_calls or ():
            assert call.function is not None
            out.calls = [
                *(out.calls or []),
                (call.function.name or "", call.function.arguments or ""),
            ]
    out.end_s = time.monotonic() - t0
    return out


def sound(name: str, arguments: str) -> bool:
    """Whether a call's arguments parse as its function's parameters."""
    try:
        given = json.loads(arguments)
    except ValueError:
        return False
    return isinstance(given, dict) and set(given) == ARGUMENTS.get(name)


async def measure(ctx: scenario.Context, sizes: Sizes) -> dict[str, list[Answer]]:
    got: dict[str, list[Answer]] = {"offered": [], "plain": [], "required": [], "auto": []}
    with ServeProcess(ctx.log_dir / "serve.log", "--pipeline", PIPELINE) as serve:
        async with openai.AsyncOpenAI(
            base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as llm:
            await ask(llm, PLAIN[0], 0, sizes.max_tokens)  # warm-up
            for r in range(sizes.rounds):
                for k, question in enumerate(PLAIN):
                    seed = 100 * r + k
                    ways = [("offered", {"tools": TOOLS}), ("plain", {})]
                    for name, tools in ways if (r + k) % 2 == 0 else reversed(ways):
                        got[name].append(await ask(llm, question, seed, sizes.max_tokens, **tools))
                for k, (question, _tool) in enumerate(CALLED):
                    seed = 100 * r + k
                    got["required"].append(await ask(
                        llm, question, seed, sizes.max_tokens, tools=TOOLS, tool_choice="required"
                    ))  # fmt: skip
                    got["auto"].append(
                        await ask(llm, question, seed, sizes.max_tokens, tools=TOOLS)
                    )
        serve.check_alive()
    return got


def ms(answers: list[Answer], of: str) -> list[float]:
    return [1e3 * getattr(a, of) for a in answers if getattr(a, of) is not None]


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    got = asyncio.run(measure(ctx, sizes))
    cfg = f"{len(got['plain'])} text answers, {len(got['required'])} calls, c=1"
    rows = []
    offered, plain = got["offered"], got["plain"]
    texts = sum(a.calls is None for a in offered)
    for metric, of in (("question -> first text", "first_s"), ("question -> end", "end_s")):
        with_tools, without = ms([a for a in offered if a.calls is None], of), ms(plain, of)
        r = ratio(percentile(with_tools, 50), percentile(without, 50))
        rows.append(Row(
            "tool_calls", cfg, f"{metric}, tools offered", "ms", percentile(with_tools, 50),
            min(with_tools), max(with_tools), percentile(with_tools, 50),
            percentile(with_tools, 99), baseline="no tools offered",
            baseline_value=percentile(without, 50), ratio=r,
            notes=[f"{texts} of {len(offered)} answered in text with tools offered (the rest "
                   "called a tool); without tools p99 " f"{percentile(without, 99):.0f} ms"],
        ))  # fmt: skip
    required = got["required"]
    made = [c for a in required for c in a.calls or ()]
    sound_calls = sum(sound(*c) for c in made)
    first_call, ended = ms(required, "first_s"), ms(required, "end_s")
    rows.append(Row(
        "tool_calls", cfg, "required: question -> first call", "ms", percentile(first_call, 50),
        min(first_call), max(first_call), percentile(first_call, 50), percentile(first_call, 99),
        baseline="the answer's end", baseline_value=percentile(ended, 50),
        ratio=ratio(percentile(first_call, 50), percentile(ended, 50)),
        notes=[f"{len(made)} calls in {len(required)} answers, "
               f"{sum(not a.calls for a in required)} answers without a whole call"],
    ))  # fmt: skip
    rows.append(Row(
        "tool_calls", cfg, "required: calls whose arguments fit their function", "%",
        100 * sound_calls / max(1, len(made)), baseline="", target="100 %",
        met=bool(made) and sound_calls == len(made),
    ))  # fmt: skip
    auto = got["auto"]
    wanted = [tool for _q, tool in CALLED] * sizes.rounds
    called_right = sum(
        a.calls is not None and a.calls[0][0] == w for a, w in zip(auto, wanted, strict=True)
    )
    answered = sum(a.calls is None for a in offered)
    rows.append(Row(
        "tool_calls", cfg, "auto: chose as it should", "%",
        100 * (called_right + answered) / (len(auto) + len(offered)), baseline="",
        notes=[f"called the right tool for {called_right} of {len(auto)} questions a tool "
               f"answers; answered in text {answered} of {len(offered)} others"],
    ))  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("tool_calls", __doc__, run, FULL, QUICK))
