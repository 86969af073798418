"""The demo stage code (workers/seed.py, workers/omni.py), in-process, without any worker runtime.

Generator stages are consumed with the worker's rules re-stated in `run_stage`, so these tests
pin the stage code's behaviour, not the runtime's.
"""

from __future__ import annotations

import inspect
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import workers.omni as omni_mod
from omni_runtime.pipeline import load_pipeline
from omni_runtime.stage_api import ChunkStream, EngineOutput, Final, TokenUsage
from omni_runtime.wav import write_wav
from workers.omni import CODEBOOK_SIZE, Code2Wav, Talker, Thinker, talker, thinker, token_codes
from workers.seed import prefix_wav, split_words, upper_all

WORKERS = Path(__file__).resolve().parents[2] / "workers"


def run_stage(result: Any) -> list[tuple[Any, bool]]:
    """(data, finished) per output: `Final` ends at once, else the last yielded is finished."""
    if not inspect.isgenerator(result):
        return [(result, True)]
    items: list[Any] = []
    for item in result:
        if isinstance(item, Final):
            return [(x, False) for x in items] + [(item.data, True)]
        items.append(item)
    if not items:
        return [(None, True)]
    return [(x, False) for x in items[:-1]] + [(items[-1], True)]


def data_of(outs: list[tuple[Any, bool]]) -> list[Any]:
    return [d for d, _ in outs]


# --- seed --------------------------------------------------------------------------------


def test_seed_hi_there() -> None:
    s0 = run_stage(split_words("hi there"))
    assert s0 == [("hi", False), ("there", True)]
    s1 = run_stage(upper_all(data_of(s0)))
    assert s1 == [(["HI", "THERE"], True)]
    s2 = run_stage(prefix_wav(data_of(s1)))
    assert s2 == [("wav:HI", False), ("wav:THERE", True)]


def test_seed_last_word_is_final_without_waiting() -> None:
    assert list(split_words("a b c")) == ["a", "b", Final("c")]
    assert list(prefix_wav([["A"], ["B", "C"]])) == ["wav:A", "wav:B", Final("wav:C")]


def test_seed_prefix_wav_streaming_input_matches_list() -> None:
    chunks = [["A", "B"], [], ["C"]]
    assert list(prefix_wav(ChunkStream(chunks, closed=True))) == list(prefix_wav(chunks))


def test_seed_empty_prompt() -> None:
    s0 = run_stage(split_words("   "))
    assert s0 == [(None, True)]
    s1 = run_stage(upper_all(data_of(s0)))
    assert s1 == [([], True)]
    assert run_stage(prefix_wav(data_of(s1))) == [(None, True)]


def test_seed_fail_word() -> None:
    assert upper_all(["a", "b"], fail_word="c") == ["A", "B"]
    with pytest.raises(ValueError, match="refusing 'b'"):
        upper_all(["a", "b"], fail_word="b")


def test_pipeline_files_load() -> None:
    seed = load_pipeline(WORKERS / "seed.yaml")
    assert (seed.mode, seed.final_stage_ids, seed.forward) == ("sequential", [0, 2], None)
    omni = load_pipeline(WORKERS / "omni.yaml")
    assert [s.entry for s in omni.stages] == [
        "workers.omni:Thinker",
        "workers.omni:Talker",
        "workers.omni:Code2Wav",
    ]


# --- omni: thinker, talker ---------------------------------------------------------------


def test_thinker_tokens() -> None:
    assert list(thinker("Hello, world!", token_delay_ms=0)) == ["Hello", ",", "world", Final("!")]
    assert run_stage(thinker("", token_delay_ms=0)) == [(None, True)]


def test_talker_deterministic() -> None:
    tokens = ["Hello", ",", "world", "!"]
    a = run_stage(talker(tokens, code_delay_ms=0))
    b = run_stage(talker(ChunkStream(tokens, closed=True), code_delay_ms=0))
    assert a == b
    assert [f for _, f in a] == [False, False, False, True]
    for (chunk, _), tok in zip(a, tokens, strict=True):
        assert chunk["token"] == tok
        assert len(chunk["codes"]) == len(tok)
        assert all(0 <= c < CODEBOOK_SIZE for c in chunk["codes"])
    # crc32, not the salted hash(): the same in every process, forever
    assert token_codes("Hi") == token_codes("Hi") != token_codes("hi")
    assert run_stage(talker([None], code_delay_ms=0)) == [(None, True)]


def engine_outputs(engine: Thinker | Talker) -> dict[str, list[tuple[Any, bool]]]:
    """(data, finished) per request, stepping until the engine has no work."""
    out: dict[str, list[tuple[Any, bool]]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).append((o.data, o.finished))
    return out


def test_batched_thinker_gives_every_request_one_token_a_step_as_the_generator_does() -> None:
    eng = Thinker(token_delay_ms=0)
    eng.add_request("a", "Hello, world!")
    eng.add_request("b", "Hi")
    eng.add_request("empty", "")
    assert [o.request_id for o in eng.step()] == ["a", "b", "empty"]  # one decode step
    eng.add_request("late", "x y")
    eng.abort("b")
    rest = engine_outputs(eng)
    assert rest["a"] == run_stage(thinker("Hello, world!", token_delay_ms=0))[1:]
    assert rest["late"] == run_stage(thinker("x y", token_delay_ms=0))
    assert "b" not in rest and "empty" not in rest


def test_batched_thinker_says_which_answers_stopped_at_max_tokens() -> None:
    eng = Thinker(token_delay_ms=0)
    eng.add_request("cut", "a b c", {"max_tokens": 2})
    eng.add_request("whole", "a b", {"max_tokens": 2})
    eng.add_request("free", "a b c")
    ends: dict[str, Any] = {}
    while eng.has_work():
        ends |= {o.request_id: (o.data, o.finish_reason, o.usage) for o in eng.step() if o.finished}
    assert ends == {
        "cut": ("b", "length", TokenUsage(3, 2)),
        "whole": ("b", "stop", TokenUsage(2, 2)),
        "free": ("c", "stop", TokenUsage(3, 3)),
    }


def test_batched_talker_matches_the_generator_in_both_modes() -> None:
    tokens = ["Hello", ",", None, "world", "!"]
    seq, streamed = Talker(code_delay_ms=0), Talker(code_delay_ms=0)
    seq.add_request("r", tokens)
    stream = ChunkStream()
    streamed.add_request("r", stream)
    assert not streamed.has_work()
    stream.extend(tokens[:2], closed=False)
    first = streamed.step()
    assert [(o.data["token"], o.finished) for o in first] == [("Hello", False)]
    stream.extend(tokens[2:], closed=True)
    want = run_stage(talker(tokens, code_delay_ms=0))
    assert engine_outputs(seq)["r"] == want
    assert [(o.data, o.finished) for o in first] + engine_outputs(streamed)["r"] == want
    late = Talker(code_delay_ms=0)  # the input closes after its last token went out
    stream = ChunkStream(["a"])
    late.add_request("r", stream)
    assert [(o.data["token"], o.finished) for o in late.step()] == [("a", False)]
    stream.extend([], closed=True)
    assert engine_outputs(late)["r"] == [(None, True)]


# --- omni: Code2Wav ----------------------------------------------------------------------


def chunks_for(*tokens: str) -> list[dict[str, Any]]:
    return [{"token": t, "codes": token_codes(t)} for t in tokens]


def drain(engine: Code2Wav) -> list[EngineOutput]:
    out: list[EngineOutput] = []
    while engine.has_work():
        out.extend(engine.step())
    return out


def assert_same(a: list[EngineOutput], b: list[EngineOutput]) -> None:
    assert [(o.request_id, o.finished, o.error) for o in a] == [
        (o.request_id, o.finished, o.error) for o in b
    ]
    for x, y in zip(a, b, strict=True):
        assert x.data.dtype == np.float32 and x.data.ndim == 1
        assert np.array_equal(x.data, y.data)


def test_code2wav_list_input() -> None:
    eng = Code2Wav()
    eng.add_request("r", chunks_for("Hello", ",", "world", "!"))
    outs = drain(eng)
    assert [o.finished for o in outs] == [False, False, False, True]
    assert [o.data.size for o in outs] == [5 * 320, 320, 5 * 320, 320]
    assert all(np.abs(o.data).max() <= 0.3 + 1e-6 for o in outs)
    assert not eng.has_work()


def test_code2wav_streaming_matches_sequential() -> None:
    chunks = chunks_for("Hello", ",", "world", "!")
    seq = Code2Wav()
    seq.add_request("r", chunks)
    expected = drain(seq)

    eng = Code2Wav()
    stream = ChunkStream()
    eng.add_request("r", stream)
    assert not eng.has_work()
    got: list[EngineOutput] = []
    for i, chunk in enumerate(chunks):
        stream.extend([chunk], closed=i == len(chunks) - 1)
        assert eng.has_work()
        got.extend(eng.step())
        assert not eng.has_work()
    assert_same(got, expected)


def test_code2wav_close_after_last_chunk_ends_with_empty_array() -> None:
    eng = Code2Wav()
    stream = ChunkStream()
    eng.add_request("r", stream)
    stream.extend(chunks_for("ab"), closed=False)
    first = eng.step()
    assert [(o.finished, o.data.size) for o in first] == [(False, 640)]
    stream.extend([], closed=True)
    assert eng.has_work()
    last = eng.step()
    assert [(o.finished, o.data.size, o.data.dtype) for o in last] == [(True, 0, np.float32)]
    assert not eng.has_work()


@pytest.mark.parametrize("data", [[], ChunkStream(closed=True), [None]])
def test_code2wav_empty_input(data: Any) -> None:
    eng = Code2Wav()
    eng.add_request("r", data)
    outs = drain(eng)
    assert [(o.finished, o.data.size, o.data.dtype) for o in outs] == [(True, 0, np.float32)]


def test_code2wav_batches_requests_in_one_step() -> None:
    solo = {}
    for rid, tok in [("a", "one"), ("b", "two!")]:
        e = Code2Wav()
        e.add_request(rid, chunks_for(tok))
        solo[rid] = drain(e)
    eng = Code2Wav()
    eng.add_request("a", chunks_for("one"))
    eng.add_request("b", chunks_for("two!"))
    outs = eng.step()
    assert {o.request_id for o in outs} == {"a", "b"}
    assert_same([o for o in outs if o.request_id == "a"], solo["a"])
    assert_same([o for o in outs if o.request_id == "b"], solo["b"])
    assert not eng.has_work()


def test_code2wav_abort() -> None:
    eng = Code2Wav()
    eng.add_request("a", chunks_for("x"))
    eng.add_request("b", chunks_for("y"))
    eng.abort("a")
    eng.abort("never-added")
    assert [o.request_id for o in drain(eng)] == ["b"]


def test_code2wav_bad_chunk_fails_only_its_request() -> None:
    eng = Code2Wav()
    eng.add_request("bad", [{"codes": [CODEBOOK_SIZE]}])
    eng.add_request("good", chunks_for("ok"))
    outs = eng.step()
    bad = [o for o in outs if o.request_id == "bad"]
    assert len(bad) == 1 and bad[0].finished and bad[0].data is None and bad[0].error
    assert [o.finished for o in outs if o.request_id == "good"] == [True]


def test_omni_chain_same_in_both_modes() -> None:
    tokens = data_of(run_stage(thinker("Hello, world!", token_delay_ms=0)))
    codes = data_of(run_stage(talker(tokens, code_delay_ms=0)))
    streamed = data_of(run_stage(talker(ChunkStream(tokens, closed=True), code_delay_ms=0)))
    assert streamed == codes
    seq, st = Code2Wav(), Code2Wav()
    seq.add_request("r", codes)
    st.add_request("r", ChunkStream(streamed, closed=True))
    assert_same(drain(st), drain(seq))


def test_write_wav(tmp_path: Path) -> None:
    eng = Code2Wav(sample_rate=8000, frame_ms=10)
    eng.add_request("r", chunks_for("Hi", "!"))
    chunks = [o.data for o in drain(eng)]
    path = tmp_path / "out.wav"
    assert write_wav(path, chunks, 8000) == 3 * 80
    with wave.open(str(path), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 8000)
        assert w.getnframes() == 3 * 80
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    assert np.allclose(pcm / 32767, np.concatenate(chunks), atol=1 / 32767)
    assert write_wav(tmp_path / "empty.wav", [], 8000) == 0


# --- omni: pacing ------------------------------------------------------------------------


def test_pacing_models_decode_steps_and_a_batched_vocoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sleeps the pipeline file's options ask for (recorded, not slept)."""
    slept: list[float] = []
    monkeypatch.setattr(omni_mod, "_sleep_ms", slept.append)
    assert len(list(thinker("a b c", token_delay_ms=20))) == 3
    assert slept == [20, 20, 20]  # per token
    slept.clear()
    list(talker(["Hello", "!"], code_delay_ms=2))
    assert slept == [10, 2]  # per code: one code per letter
    slept.clear()
    eng = Code2Wav(sample_rate=16000, frame_ms=20, real_time_factor=50)
    eng.add_request("long", chunks_for("Hello", "world"))  # 10 codes: 200 ms of audio
    eng.add_request("short", chunks_for("Hi"))  # 40 ms
    outs = eng.step()
    assert sum(len(o.data) for o in outs) == 12 * 320
    assert slept == [pytest.approx(200 / 50)]  # the batch's longest request, 50x real time
    assert Code2Wav().real_time_factor == 0  # unpaced unless asked
    with pytest.raises(ValueError, match="real_time_factor"):
        Code2Wav(real_time_factor=-1)
