"""The front door's request parameters, chat prompts, transcriptions and several pipelines,
over the HTTP path (an in-process cluster per pipeline on fakeredis)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
import pytest_asyncio
import soundfile

from omni_runtime.http.audio import STREAMING_SIZE, wav_header
from omni_runtime.http.gateway import Gateway
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings
from tests.integration.http_support import (
    CHAT,
    assert_error,
    fake_redis_clients,
    fast_settings,
    omni,
    pipeline_of,
    serving,
    sse_events,
    wav_file,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio(loop_scope="module")]

TRANSCRIBE = "/v1/audio/transcriptions"
SPEECH = "/v1/audio/speech"
CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
    {"role": "user", "content": "How are you?"},
]


@pytest.fixture
def fake_clients() -> RedisClients:
    return fake_redis_clients()


@pytest.fixture
def settings() -> Settings:
    return fast_settings()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api() -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    """One server for the module's requests (its setup and stop cost more than most of
    them): each test's requests end before the test does, so none sees another's."""
    pipelines = [pipeline_of("echo"), pipeline_of("transcribe"), omni()]
    clients = fake_redis_clients()
    async with serving(pipelines, clients, fast_settings(), max_upload_bytes=64_000) as served:
        yield served


def echoed(resp: httpx.Response) -> dict[str, Any]:
    """What the echo pipeline's stage 0 was given (its answer is that, as JSON)."""
    assert resp.status_code == 200, resp.text
    said: dict[str, Any] = json.loads(resp.json()["choices"][0]["message"]["content"])
    return said


def pcm_of(resp: httpx.Response) -> np.ndarray:
    """A WAV response's samples, as floats."""
    assert resp.status_code == 200, resp.text
    return np.frombuffer(resp.content[44:], "<i2").astype(np.float64) / 32767


async def test_chat_params_and_messages_reach_the_stages(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    body = {
        "model": "echo",
        "messages": CONVERSATION,
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": "\n",
        "seed": 3,
        "frequency_penalty": 0.25,
        "presence_penalty": -0.5,
        "modalities": ["text", "audio"],
        "audio": {"format": "wav", "voice": "low"},
    }
    resp = await client.post(CHAT, json=body)
    said = echoed(resp)
    assert said["params"] == {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["\n"],
        "seed": 3,
        "frequency_penalty": 0.25,
        "presence_penalty": -0.5,
        "voice": "low",
    }
    roles = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello")]
    roles.append(("user", "How are you?"))
    assert said["prompt"] == {"messages": [{"role": r, "content": c} for r, c in roles]}
    # the voice reached the audio stage too: its level is the voice's
    audio = resp.json()["choices"][0]["message"]["audio"]["data"]
    pcm = np.frombuffer(base64.b64decode(audio)[44:], "<i2") / 32767
    assert pcm.size == 1600 and np.allclose(pcm, 0.25, atol=1e-4)

    newer = {"model": "echo", "messages": CONVERSATION, "max_tokens": 7}
    newer["max_completion_tokens"] = 9
    text_only = {"modalities": ["text"]}  # the pipeline speaks: its TTS stages need not
    assert echoed(await client.post(CHAT, json=newer))["params"] == {"max_tokens": 9, **text_only}
    plain = echoed(await client.post(CHAT, json={"model": "echo", "messages": CONVERSATION}))
    assert plain["params"] == text_only


SCHEMA = {
    "name": "person",
    "schema": {"type": "object", "properties": {"age": {"type": "integer"}}},
}
HUGE = {"type": "object", "description": "x" * 4096}


async def test_a_structured_pipeline_gets_the_json_asked_for_as_params(
    fake_clients: RedisClients, settings: Settings
) -> None:
    """`response_format` reaches the stages of a pipeline whose text stage shapes JSON
    (`outputs.structured`): the kind, and the schema as compact JSON (a param's size)."""
    async with serving([pipeline_of("echo", structured=True)], fake_clients, settings) as (
        client,
        _gateway,
    ):
        body: dict[str, Any] = {"model": "echo", "messages": CONVERSATION}
        schema = {"type": "json_schema", "json_schema": {**SCHEMA, "strict": True}}
        said = echoed(await client.post(CHAT, json={**body, "response_format": schema}))
        compact = '{"type":"object","properties":{"age":{"type":"integer"}}}'
        text_only = {"modalities": ["text"]}
        assert (
            said["params"] == {"response_format": "json_schema", "json_schema": compact} | text_only
        )
        anything = {"type": "json_object"}
        said = echoed(await client.post(CHAT, json={**body, "response_format": anything}))
        assert said["params"] == {"response_format": "json_object"} | text_only
        said = echoed(await client.post(CHAT, json={**body, "response_format": {"type": "text"}}))
        assert said["params"] == text_only


async def test_a_text_pipeline_gets_the_last_user_message(
    fake_clients: RedisClients, settings: Settings
) -> None:
    async with serving([pipeline_of("echo", input="text")], fake_clients, settings) as (api, _g):
        said = echoed(await api.post(CHAT, json={"model": "echo", "messages": CONVERSATION}))
    assert said["prompt"] == "How are you?"


async def test_a_typed_chat_to_a_pipeline_that_hears_is_a_turn_with_nothing_to_hear(
    fake_clients: RedisClients, settings: Settings
) -> None:
    """`outputs.text_turns`: a chat without audio goes as `{"wav": None, "messages"}` (its
    speech-to-text stage hears no words); without it, the 400 asking for speech."""
    hears = pipeline_of("echo", input="audio", text_turns=True)
    async with serving([hears], fake_clients, settings) as (api, _g):
        said = echoed(await api.post(CHAT, json={"model": "echo", "messages": CONVERSATION}))
        assert (await api.get("/playground/config")).json()["takes_text"]  # its text box
    assert said["prompt"] == {"wav": None, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "How are you?"},
    ]}  # fmt: skip
    deaf = pipeline_of("echo", input="audio")
    async with serving([deaf], fake_clients, settings) as (api, _g):
        resp = await api.post(CHAT, json={"model": "echo", "messages": CONVERSATION})
        assert not (await api.get("/playground/config")).json()["takes_text"]
    assert "takes speech" in assert_error(resp, 400, "messages.3.content")["message"]


async def test_speech_voice_and_speed_reach_the_audio_stage(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    base = {"model": "echo", "input": "Say this"}
    plain = pcm_of(await client.post(SPEECH, json=base))
    assert plain.size == 1600 and np.allclose(plain, 0.1, atol=1e-4)
    fast = pcm_of(await client.post(SPEECH, json={**base, "voice": "high", "speed": 2.0}))
    assert fast.size == 800 and np.allclose(fast, 0.5, atol=1e-4)
    slow = pcm_of(await client.post(SPEECH, json={**base, "voice": {"id": "low"}, "speed": 0.5}))
    assert slow.size == 3200 and np.allclose(slow, 0.25, atol=1e-4)
    # refused for what it asked: the client's fault, a 400 in the stage's words and code
    unknown = assert_error(await client.post(SPEECH, json={**base, "voice": "nobody"}), 400)
    assert "unknown voice 'nobody'" in unknown["message"]
    assert unknown["message"].startswith("stage 1 failed: "), unknown  # its stage named once
    assert (unknown["type"], unknown["code"]) == ("invalid_request_error", "invalid_value")
    # the stage's own failure: a 502, which a client may retry
    broke = assert_error(await client.post(SPEECH, json={**base, "voice": "crash"}), 502)
    assert "the tone generator broke" in broke["message"]
    assert (broke["type"], broke["code"]) == ("server_error", "pipeline_error")


def encoded(seconds: float, container: str, subtype: str, rate: int = 16000) -> bytes:
    """`seconds` of a tone, as a file libsndfile writes (MP3, FLAC, Ogg)."""
    out = io.BytesIO()
    tone = 0.3 * np.sin(np.arange(round(seconds * rate)) / 5)
    soundfile.write(out, tone, rate, subtype, format=container)
    return out.getvalue()


@pytest.mark.parametrize(
    ("container", "subtype", "rate"),
    [("MP3", "MPEG_LAYER_III", 16000), ("FLAC", "PCM_16", 16000), ("OGG", "VORBIS", 16000),
     ("OGG", "OPUS", 48000), ("WAV", "FLOAT", 8000)],
)  # fmt: skip
async def test_a_recording_in_openais_other_formats_is_heard_as_a_wav(
    api: tuple[httpx.AsyncClient, Gateway], container: str, subtype: str, rate: int
) -> None:
    """MP3, FLAC, Ogg, a float WAV: decoded at the door; the stage gets 16-bit PCM."""
    client, _gateway = api
    data = encoded(1.0, container, subtype, rate)
    resp = await client.post(TRANSCRIBE, data={"model": "transcribe"}, files={"file": ("a", data)})
    assert resp.status_code == 200, resp.text
    seconds, heard = resp.json()["text"].split(" s, ")
    assert heard == f"{rate} Hz, 1 ch, language -"
    assert 1.0 <= float(seconds) <= 1.0 + 2 * 1152 / rate  # MP3 pads its frames
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(),
                                                   "format": "mp3"}}  # fmt: skip
    chat = {"model": "transcribe", "messages": [{"role": "user", "content": [part]}]}
    said = await client.post(CHAT, json=chat)
    assert said.json()["choices"][0]["message"]["content"] == resp.json()["text"]


async def test_transcription_of_a_multipart_wav(api: tuple[httpx.AsyncClient, Gateway]) -> None:
    client, _gateway = api
    form = {"model": "transcribe", "language": "en"}
    resp = await client.post(TRANSCRIBE, data=form, files={"file": ("a.wav", wav_file(1.25))})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"text": "1.2500 s, 16000 Hz, 1 ch, language en"}
    assert resp.headers["X-Omni-Request-Id"]
    # a streamed WAV (sizes "until the end"), as the speech endpoint sends it, as text
    streamed = wav_header(8000, STREAMING_SIZE) + wav_file(0.5, rate=8000)[44:]
    form = {"model": "transcribe", "response_format": "text"}
    resp = await client.post(TRANSCRIBE, data=form, files={"file": ("s.wav", streamed)})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    assert resp.text == "0.5000 s, 8000 Hz, 1 ch, language -"


async def test_a_streamed_transcription_is_openais_text_events(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    """`stream=true`: a `transcript.text.delta` per piece, then `transcript.text.done`
    with the whole text (no usage: this engine counts no tokens); a recording it cannot
    read is still an error status, before any event."""
    client, gateway = api
    form = {"model": "transcribe", "language": "en", "stream": "true"}
    resp = await client.post(TRANSCRIBE, data=form, files={"file": ("a.wav", wav_file(1.25))})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    *deltas, done = sse_events(resp.text)
    text = "1.2500 s, 16000 Hz, 1 ch, language en"
    assert [d["type"] for d in deltas] == ["transcript.text.delta"] * len(deltas) != []
    assert "".join(d["delta"] for d in deltas) == text
    assert done == {"type": "transcript.text.done", "text": text}
    bad = await client.post(TRANSCRIBE, data=form, files={"file": ("x.wav", wav_file(0))})
    assert_error(bad, 400, "file")
    assert gateway.inflight == 0


@pytest.mark.parametrize(
    ("data", "file", "status", "param"),
    [
        ({"model": "transcribe"}, b"ID3 not a wav at all", 400, "file"),
        ({"model": "transcribe"}, wav_file(0), 400, "file"),
        ({"model": "transcribe"}, wav_file(1.0)[:30], 400, "file"),
        ({"model": "transcribe"}, b"", 400, "file"),
        ({"model": "transcribe"}, wav_file(0.1, rate=1), 400, "file"),
        ({"model": "transcribe"}, wav_file(0.001, rate=400_000), 400, "file"),
        ({"model": "transcribe"}, wav_file(2.5), 413, None),
        ({"model": "transcribe"}, None, 400, "file"),
        ({}, wav_file(0.1), 400, "model"),
        ({"model": "transcribe", "response_format": "tsv"}, wav_file(0.1), 400, "response_format"),
        ({"model": "echo"}, wav_file(0.1), 400, "model"),
        ({"model": "omni"}, wav_file(0.1), 400, "model"),
        ({"model": "whisper-1"}, wav_file(0.1), 404, "model"),
    ],
    ids=[
        "not-wav", "no-frames", "cut-header", "empty", "rate-1-hz", "rate-400-khz", "too-large", "no-file", "no-model", "tsv",
        "chat-pipeline", "omni", "unknown-model",
    ],
)  # fmt: skip
async def test_bad_transcriptions_are_openai_errors(
    api: tuple[httpx.AsyncClient, Gateway],
    data: dict[str, str],
    file: bytes | None,
    status: int,
    param: str | None,
) -> None:
    client, gateway = api
    files = {"file": ("x.wav", file)} if file is not None else {"other": ("x", b"x")}
    error = assert_error(await client.post(TRANSCRIBE, data=data, files=files), status, param)
    assert gateway.inflight == 0
    if param == "file":
        assert error["code"] in {"invalid_audio", "invalid_value"}
        assert not error["message"].endswith("()"), error  # a reason, in words


async def test_models_lists_every_pipeline_and_requests_choose_theirs(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["echo", "transcribe", "omni"]
    assert (await client.get("/v1/models/transcribe")).json()["id"] == "transcribe"
    assert_error(await client.get("/v1/models/gpt-4o"), 404, "model")
    ready = (await client.get("/ready")).json()
    assert ready["pipelines"] == ["echo", "transcribe", "omni"]
    said = await client.post(CHAT, json={"model": "omni", "messages": CONVERSATION})
    assert said.json()["choices"][0]["message"]["content"] == "How are you ?"
    config = (await client.get("/playground/config")).json()
    assert config["model"] == "echo" and config["takes_text"]
    assert config["talk_model"] is None  # transcribe takes speech but does not answer aloud
    for script in ("talk.js", "mic-worklet.js"):
        served = await client.get(f"/playground/{script}")
        assert served.status_code == 200, script
        assert served.headers["content-type"].startswith("text/javascript")
    assert (await client.get("/playground/app.py")).status_code == 404


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 1 << 21}, "max_completion_tokens"),
        ({"seed": -1}, "seed"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"n": 2}, "n"),
        ({"temperature": 5}, "temperature"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),  # not structured
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object", "json_schema": SCHEMA}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {**SCHEMA, "name": "a b"}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {**SCHEMA, "schema": HUGE}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"audio": {"voice": ""}, "modalities": ["text", "audio"]}, "audio.voice"),
    ],
)
async def test_bad_chat_values_are_400(
    api: tuple[httpx.AsyncClient, Gateway], extra: dict[str, Any], param: str
) -> None:
    client, gateway = api
    body = {"model": "echo", "messages": CONVERSATION, **extra}
    error = assert_error(await client.post(CHAT, json=body), 400, param)
    assert error["type"] == "invalid_request_error"
    assert gateway.inflight == 0


async def test_non_finite_values_are_400(api: tuple[httpx.AsyncClient, Gateway]) -> None:
    client, _gateway = api
    for body, param in [
        (b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
         "temperature"),
        (b'{"model": "echo", "input": "x", "speed": Infinity}', "speed"),
    ]:  # fmt: skip
        path = SPEECH if b'"input"' in body else CHAT
        resp = await client.post(path, content=body, headers={"content-type": "application/json"})
        assert_error(resp, 400, param)


async def test_requests_a_pipeline_cannot_serve_are_400(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, _gateway = api
    chat = {"model": "transcribe", "messages": CONVERSATION}
    error = assert_error(await client.post(CHAT, json=chat), 400, "messages.3.content")
    assert "input_audio part" in error["message"] and "/v1/audio/transcriptions" in error["message"]
    speech = {"model": "transcribe", "input": "hi"}
    assert_error(await client.post(SPEECH, json=speech), 400, "model")
    for bad in ({"speed": 4.5}, {"speed": 0.2}, {"voice": ""}):
        body = {"model": "echo", "input": "hi", **bad}
        assert_error(await client.post(SPEECH, json=body), 400, next(iter(bad)))


def spoken(wav: bytes | str, text: str | None = None) -> dict[str, Any]:
    """A user message carrying speech, as OpenAI's audio chat models take it."""
    data = wav if isinstance(wav, str) else base64.b64encode(wav).decode()
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    parts.append({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
    return {"role": "user", "content": parts}


async def test_a_chat_message_may_carry_speech_for_a_pipeline_that_hears(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, gateway = api
    heard = [*CONVERSATION[:3], spoken(wav_file(1.25), text="Listen:")]
    said = await client.post(CHAT, json={"model": "transcribe", "messages": heard})
    assert said.status_code == 200, said.text
    assert said.json()["choices"][0]["message"]["content"] == "1.2500 s, 16000 Hz, 1 ch, language -"
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    for messages, param, words in [
        ([spoken(wav_file(0.1)), spoken(wav_file(0.1))], "messages.0.content", "only the last"),
        ([{"role": "user", "content": [audio, audio]}], "messages.0.content", "one input_audio"),
        ([spoken("not base64!")], "messages.0.content", "not base64"),
        ([spoken(b"RIFF but no WAV")], "messages.0.content", "not a PCM WAV file"),
        ([spoken(wav_file(0))], "messages.0.content", "holds no audio"),
    ]:
        body = {"model": "transcribe", "messages": messages}
        error = assert_error(await client.post(CHAT, json=body), 400, param)
        assert words in error["message"], error
    flac = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "flac"}}
    body = {"model": "transcribe", "messages": [{"role": "user", "content": [flac]}]}
    error = assert_error(await client.post(CHAT, json=body), 400)
    assert "input_audio.format: Input should be 'wav' or 'mp3'" in error["message"], error
    junk = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}}
    body = {"model": "transcribe", "messages": [{"role": "user", "content": [junk]}]}
    error = assert_error(await client.post(CHAT, json=body), 400, "messages.0.content")
    assert "not a WAV, MP3, FLAC or Ogg file (Format not recognised.)" in error["message"]
    body = {"model": "echo", "messages": [spoken(wav_file(0.1))]}
    error = assert_error(await client.post(CHAT, json=body), 400, "model")
    assert "takes text, not audio" in error["message"]
    assert gateway.inflight == 0


async def test_max_tokens_reaches_the_thinker_and_usage_counts_the_prompt(
    api: tuple[httpx.AsyncClient, Gateway],
) -> None:
    """They were accepted and ignored: the demo's thinker said every token, and
    `usage.prompt_tokens` was always 0. An answer cut at `max_tokens` said it had stopped
    ("stop"): OpenAI says "length", by which a client knows the answer is not whole."""
    client, _gateway = api
    said = "Hello, world! How are you?"
    body = {"model": "omni", "messages": [{"role": "user", "content": said}], "max_tokens": 3}
    whole = (await client.post(CHAT, json=body)).json()
    assert whole["choices"][0]["message"]["content"] == "Hello , world"
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11,
                              "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    streamed = await client.post(
        CHAT, json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line[6:7] == "{"]
    assert events[-1]["usage"] == whole["usage"]
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if "finish_reason" in c]
    assert reasons == ["length"], "said once, on the last chunk"
    roomy = (await client.post(CHAT, json={**body, "max_tokens": 8})).json()
    assert roomy["choices"][0]["finish_reason"] == "stop"  # its whole answer is 8 tokens
    tooled = {**body, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    assert (await client.post(CHAT, json=tooled)).status_code == 200  # asks for nothing more
