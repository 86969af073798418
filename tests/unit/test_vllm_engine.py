"""The vLLM adapter against a fake `AsyncLLM` (tests/engines/fake_vllm.py): what it asks
of vLLM (sampling parameters, DELTA outputs, aborts) and what it makes of vLLM's answers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest

from omni_runtime.engines.vllm import VllmEngine, finished_usage
from omni_runtime.errors import ConfigError
from omni_runtime.pipeline import StageConfig
from omni_runtime.stage_api import (
    ChunkStream,
    EngineDead,
    EngineStats,
    Final,
    RequestRefused,
    TokenUsage,
)
from omni_runtime.worker.async_engine import AsyncEngineDriver
from omni_runtime.worker.engines import load_engine
from tests.engines.fake_vllm import FakeAsyncLLM, FakeVllm, RequestOutputKind
from tests.waiting import wait_for, wait_until

pytestmark = pytest.mark.timeout(30)


async def started(fake: FakeVllm, **options: Any) -> tuple[VllmEngine, FakeAsyncLLM]:
    engine = VllmEngine("fake/model", api=fake.api(), **options)
    await engine.start()
    assert fake.engine is not None
    return engine, fake.engine


async def run(engine: VllmEngine, rid: str, data: Any, params: Any = None) -> list[Any]:
    return [item async for item in engine.generate(rid, data, params)]


def test_the_module_imports_without_vllm() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # any `import vllm...` now fails
        "import omni_runtime.engines.vllm as m\n"
        "e = m.VllmEngine('some/model')\n"
        "assert 'vllm' not in [k for k, v in sys.modules.items() if v is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_start_without_vllm_says_what_to_install() -> None:
    engine = VllmEngine("some/model")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"needs vllm installed.*docs/vllm\.md"):
            await engine.start()
    else:
        pytest.skip("vllm is installed here")


async def test_the_engine_is_built_in_start_with_the_model_and_engine_args() -> None:
    fake = FakeVllm()
    engine = VllmEngine("org/model", engine_args={"max_num_seqs": 8}, api=fake.api())
    assert fake.builds == 0, "nothing is loaded before start()"
    await engine.start()
    assert fake.engine is not None
    assert (fake.engine.model, fake.engine.max_num_seqs) == ("org/model", 8)
    assert engine.stats() == EngineStats(running=0, waiting=0, capacity=8)
    await engine.close()


async def test_text_streams_as_deltas_and_the_last_piece_is_final() -> None:
    engine, fake = await started(FakeVllm())
    items = await run(engine, "r", "hello there", {"max_tokens": 5})
    assert items == [
        " hello",
        " there",
        " hello",
        " there",
        Final(" hello", "length", TokenUsage(prompt_tokens=2, completion_tokens=5)),
    ]
    assert fake.seen["r"].output_kind == RequestOutputKind.DELTA
    await engine.close()


async def test_sampling_defaults_and_request_params_reach_vllm() -> None:
    sampling = {"temperature": 0.2, "max_tokens": 7, "top_p": 0.9}
    engine, fake = await started(FakeVllm(), sampling=sampling)
    params = {"max_tokens": 2, "temperature": 0.0, "stop": ["\n"], "seed": 42, "voice": "x"}
    await run(engine, "r", "a b c", {**params, "frequency_penalty": 0.5, "presence_penalty": -1})
    sp = fake.seen["r"]
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.stop, sp.seed) == (2, 0.0, 0.9, ["\n"], 42)
    assert (sp.frequency_penalty, sp.presence_penalty) == (0.5, -1)
    await run(engine, "d", "a b c")
    assert (fake.seen["d"].max_tokens, fake.seen["d"].temperature) == (7, 0.2)
    await engine.close()


async def test_a_stop_string_ends_the_text_before_it() -> None:
    engine, _fake = await started(FakeVllm())
    items = await run(engine, "r", "one two END three", {"stop": "END", "max_tokens": 50})
    assert "".join(i.data if isinstance(i, Final) else i for i in items) == " one two "
    assert isinstance(items[-1], Final) and items[-1].finish_reason == "stop", "no limit reached"
    await engine.close()


async def test_json_output_and_tools_are_refused_not_ignored() -> None:
    engine, fake = await started(FakeVllm())
    with pytest.raises(RequestRefused, match="response_format") as refused:
        await run(engine, "json", "x", {"response_format": "json_object"})
    assert refused.value.code == "unsupported_parameter"
    with pytest.raises(RequestRefused, match="tools") as refused:
        await run(engine, "tools", "x", {"tools": ['{"name": "f"}']})
    assert refused.value.code == "unsupported_parameter"
    assert "json" not in fake.seen and "tools" not in fake.seen, "nothing reached vLLM"
    await engine.close()


@pytest.mark.parametrize(
    "params, message",
    [
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"temperature": "hot"}, "temperature='hot'"),
        ({"top_p": 0}, "top_p=0"),
        ({"stop": [1]}, r"stop=\[1\]"),
        ({"seed": True}, "seed=True"),
        ({"presence_penalty": 2.5}, "presence_penalty=2.5"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty=nan"),
    ],
)
async def test_a_bad_parameter_fails_its_request_with_a_message_naming_it(
    params: dict[str, Any], message: str
) -> None:
    engine, fake = await started(FakeVllm())
    with pytest.raises(RequestRefused, match=message) as refused:  # the client's fault: a 400
        await run(engine, "bad", "x", params)
    assert refused.value.code == "invalid_value"
    assert "bad" not in fake.seen, "nothing reached vLLM"
    assert await run(engine, "good", "x", {"max_tokens": 1}) == [
        Final(" x", "length", TokenUsage(1, 1))
    ]
    await engine.close()


def test_a_bad_sampling_option_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="option `sampling`: 'voice'"):
        VllmEngine("m", sampling={"voice": "x"})


async def test_upstream_chunks_are_joined_into_the_prompt() -> None:
    engine, _fake = await started(FakeVllm())
    joined = await run(engine, "l", ["one", " two"], {"max_tokens": 1})
    assert joined == [Final(" one", "length", TokenUsage(2, 1))]  # "one two": 2 words
    stream = ChunkStream(["three", " four"], closed=True)
    streamed = await run(engine, "s", stream, {"max_tokens": 2})
    assert streamed == [" three", Final(" four", "length", TokenUsage(2, 2))]
    with pytest.raises(ValueError, match="must be text"):
        await run(engine, "n", 12)
    await engine.close()


async def test_a_dead_engine_is_engine_dead_in_checks_and_in_generate() -> None:
    engine, fake = await started(FakeVllm(token_delay_s=0.002))
    await engine.check_health()
    items: list[Any] = []

    async def consume() -> None:
        async for item in engine.generate("r", "go", {"max_tokens": 100_000}):
            items.append(item)

    task = asyncio.create_task(consume())
    await wait_for(lambda: bool(items))
    fake.kill("engine core process died")
    with pytest.raises(EngineDead, match="engine core process died"):
        await task
    with pytest.raises(EngineDead, match="errored"):
        await engine.check_health()
    await engine.close()


async def test_abort_and_close_reach_vllm_and_close_is_idempotent() -> None:
    engine, fake = await started(FakeVllm())
    await engine.abort("unknown")
    await engine.close()
    await engine.close()
    assert fake.shut_down == 1
    with pytest.raises(EngineDead, match="not started"):
        await engine.check_health()


def test_through_the_worker_driver_from_a_pipeline_entry() -> None:
    stage = StageConfig(
        id=0,
        name="thinker",
        entry="omni_runtime.engines.vllm:VllmEngine",
        options={"model": "fake/model", "api": "tests.engines.fake_vllm:api"},
    )
    driver = load_engine(stage, None, max_concurrency=4, wake=lambda: None)
    assert isinstance(driver, AsyncEngineDriver)
    driver.start()
    driver.add_request("r", "to be", params={"max_tokens": 3})
    outs: list[Any] = []

    def ended() -> bool:
        outs.extend(driver.step())
        return bool(outs) and outs[-1].finished

    wait_until(ended)
    assert [(o.data, o.finished) for o in outs] == [(" to", False), (" be", False), (" to", True)]
    driver.close()


@pytest.mark.parametrize(("cached", "held"), [(None, 0), (0, 0), (6, 6), (99, 10), (-1, 0)])
def test_cached_tokens_are_those_vllm_says_its_prefix_cache_held(cached: Any, held: int) -> None:
    """`num_cached_tokens` (None when vLLM keeps no prefix cache), some of the prompt's."""
    out = type("Out", (), {"num_cached_tokens": cached})()
    assert finished_usage(out, 10, 3) == TokenUsage(10, 3, held)
