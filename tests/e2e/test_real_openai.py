"""The official `openai` client against `omni-runtime serve` on the real models: a chat
answer streamed as text and speech, speech in a chosen voice, that speech transcribed
back to its words, and a spoken question answered aloud (serve fronting
workers/voice.yaml, speak.yaml, transcribe.yaml and listen.yaml)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest
import soundfile
import websockets
import yaml
from openai.types.chat import (
    ChatCompletionContentPartInputAudioParam,
    ChatCompletionMessageParam,
)

from omni_runtime.engines.wer import wer
from omni_runtime.http.audio import wav_bytes
from omni_runtime.local.launcher import redis_server_binary
from tests.e2e.realtime_client import RATE, Heard, recv, speech, take, until_done
from tests.e2e.serving import ROOT, ServeProcess
from tests.e2e.test_real_voice import needs_engines  # noqa: F401 (a module-wide fixture)
from tests.services import unavailable

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    if redis_server_binary() is None:
        unavailable("no redis-server on PATH", "a redis-server")
    where = tmp_path_factory.mktemp("serve")
    # `speak` without piper's sampling noise: what is said back is heard the same way in
    # every run (sampled, "the quick brown fox" was once heard as "but quite brown talks")
    speak = yaml.safe_load((ROOT / "workers" / "speak.yaml").read_text())
    speak["stages"][1].setdefault("options", {}).update(noise_scale=0, noise_w_scale=0)
    (where / "speak.yaml").write_text(yaml.safe_dump(speak))
    pipelines = (
        f"workers/voice.yaml,{where / 'speak.yaml'},workers/transcribe.yaml,workers/listen.yaml"
    )
    with ServeProcess(where / "serve.log", "--pipeline", pipelines, "--mode", "streaming") as serve:
        yield serve


@pytest.fixture
def client(server: ServeProcess) -> Iterator[openai.OpenAI]:
    """Closed after each test: its pooled connections are not left to the collector."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def wav_frames(data: bytes) -> tuple[int, int]:
    """(sample rate, frames) of a WAV, streamed (its header says "until the end") or not."""
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        frames = len(w.readframes(1 << 30)) // 2
        return w.getframerate(), frames


def test_a_streamed_chat_answer_comes_as_text_and_speech(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="voice",
        # A long answer: its text takes seconds to write, its first words a fraction of that
        messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
        modalities=["text", "audio"],
        audio={"format": "pcm16", "voice": "joe"},
        max_tokens=160,
        seed=3,
        stream=True,
    )
    text, audio, first_audio_after = [], bytearray(), None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text.append(delta.content or "")
        data = getattr(getattr(delta, "audio", None), "data", None) or (
            (getattr(delta, "model_extra", None) or {}).get("audio") or {}
        ).get("data")
        if data:
            first_audio_after = (
                len("".join(text)) if first_audio_after is None else first_audio_after
            )
            audio += base64.b64decode(data)
    answer = "".join(text)
    assert len(answer.split()) >= 3, answer
    assert len(audio) > 2 * 8000 and len(audio) % 2 == 0  # over half a second of PCM16
    # Streamed: the first audio came while the answer was still being written.
    assert first_audio_after is not None and first_audio_after < len(answer), answer


def test_a_whole_chat_answer_speaks_its_own_text(client: openai.OpenAI) -> None:
    """In `alloy`, an OpenAI voice piper does not have: piper's default voice speaks."""
    whole = client.chat.completions.create(
        model="voice",
        messages=[{"role": "user", "content": "What do bees make?"}],
        modalities=["text", "audio"],
        audio={"format": "wav", "voice": "alloy"},
        max_tokens=48,
        seed=7,
    )
    message = whole.choices[0].message
    assert message.audio is not None
    wav = base64.b64decode(message.audio.data)
    heard = client.audio.transcriptions.create(model="transcribe", file=("answer.wav", wav))
    said = message.content or message.audio.transcript or ""
    assert said.strip() and wer(said, heard.text) <= 0.35, (said, heard.text)


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_an_answer_parsed_into_a_pydantic_model_comes_as_its_json(
    client: openai.OpenAI,
) -> None:
    """The client's own structured outputs (`parse`): it sends the model's strict JSON
    schema; llama.cpp's grammar binds the thinker's tokens to it, so the answer parses."""
    parsed = client.chat.completions.parse(
        model="voice",
        messages=[{"role": "user", "content": "Describe a person named Ada who is 36."}],
        response_format=Person,
        max_tokens=128,  # room: JSON cut at the limit does not parse
        temperature=0,
    )
    message = parsed.choices[0].message
    assert parsed.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Person), message.content
    assert message.parsed.name.strip()


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""

    city: str


def test_a_voice_chat_calls_a_tool_says_nothing_of_it_and_speaks_the_answer_after(
    client: openai.OpenAI,
) -> None:
    """The client's own function calling (`pydantic_function_tool`, strict): the call the
    grammar held the thinker to parses into the client's model; streamed with audio, it
    comes as a `tool_calls` delta and no speech; its result sent back, the answer is text
    and is spoken."""
    tools = [openai.pydantic_function_tool(GetWeather)]
    asked: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "What is the weather in Paris?"}
    ]
    parsed = client.chat.completions.parse(
        model="voice", messages=asked, tools=tools, tool_choice="required", max_tokens=120,
        parallel_tool_calls=False,  # one call: the answer ends with it, never at max_tokens
    )  # fmt: skip
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    call = choice.message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert call.function.parsed_arguments.city.strip()

    stream = client.chat.completions.create(
        model="voice", messages=asked, tools=tools, tool_choice="required", max_tokens=120,
        modalities=["text", "audio"], audio={"format": "pcm16", "voice": "alloy"}, stream=True,
    )  # fmt: skip
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [t for d in deltas for t in d.delta.tool_calls or ()]
    assert streamed and all(t.function and t.function.name == "GetWeather" for t in streamed)
    assert [t.index for t in streamed] == list(range(len(streamed)))  # each call as it closed
    assert len({t.id for t in streamed}) == len(streamed)
    assert [d.finish_reason for d in deltas if d.finish_reason] in (["tool_calls"], ["length"])
    spoken = [d for d in deltas if ((d.delta.model_extra or {}).get("audio") or {}).get("data")]
    assert not spoken and not any(d.delta.content for d in deltas)

    result: ChatCompletionMessageParam = {
        "role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 18}'
    }  # fmt: skip
    made: ChatCompletionMessageParam = choice.message.model_dump(exclude_none=True)  # type: ignore[assignment]
    history = [*asked, made, result]
    after = client.chat.completions.create(
        model="voice", messages=history, tools=tools, tool_choice="none", max_tokens=64,
        modalities=["text", "audio"], audio={"format": "wav", "voice": "alloy"}, seed=1,
    )  # fmt: skip
    message = after.choices[0].message
    assert after.choices[0].finish_reason in ("stop", "length") and not message.tool_calls
    assert message.content and message.audio is not None
    assert wav_frames(base64.b64decode(message.audio.data))[1] > 8000, message.content


async def test_a_realtime_session_calls_a_tool_and_speaks_the_answer_to_its_output(
    server: ServeProcess,
) -> None:
    """OpenAI's Realtime function calling with its own client: a session's tool called as a
    `function_call` item (its arguments in one delta, then done; no speech), the output
    the client adds for it read with the next response, which is spoken."""
    weather: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}  # fmt: skip
    api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    async with api.realtime.connect(model="voice") as conn:
        assert (await recv(conn)).type == "session.created"
        await conn.session.update(session={
            "type": "realtime", "tools": [weather], "tool_choice": "required",
            "audio": {"input": {"turn_detection": None}},
        })  # fmt: skip
        updated: Any = await recv(conn)
        assert updated.type == "session.updated", updated
        assert [t.name for t in updated.session.tools] == ["get_weather"]
        await conn.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "What is the weather in Paris?"}],
        })  # fmt: skip
        await conn.response.create()
        calls: list[Any] = []
        heard = Heard()
        async with asyncio.timeout(120):
            while heard.done is None:
                ev = await recv(conn)
                take(heard, ev)
                if ev.type == "response.function_call_arguments.done":
                    calls.append(ev)
        # ended at its first repeated call; or cut at the thinker's max_tokens: incomplete
        assert heard.errors == [] and heard.status in ("completed", "incomplete"), heard.kinds
        assert calls and calls[0].name == "get_weather", heard.kinds
        assert json.loads(calls[0].arguments)["city"].strip()
        assert not heard.audio  # a call says nothing
        output = [o for o in heard.done.response.output if o.type == "function_call"]
        assert [o.call_id for o in output] == [c.call_id for c in calls]

        await conn.conversation.item.create(item={
            "type": "function_call_output", "call_id": calls[0].call_id,
            "output": '{"sky": "sunny", "celsius": 18}',
        })  # fmt: skip
        await conn.response.create(response={"tool_choice": "none"})
        answer = await until_done(conn)
    assert answer.errors == [] and answer.status in ("completed", "incomplete"), answer.kinds
    assert "response.function_call_arguments.done" not in answer.kinds
    assert answer.transcript.strip() and len(answer.audio) > 2 * RATE // 2, answer.transcript


async def test_a_models_tokens_written_into_a_speech_stream_are_heard_back(
    server: ServeProcess,
) -> None:
    """What an agent does with `/v1/audio/speech/stream`: a model's answer, streamed, goes
    in token by token as it comes; piper's speech of it comes back, piece by piece, in
    order, and is heard back as the answer's words."""
    ws_url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream?model=speak"
    pcm, events, said = bytearray(), [], ""
    first_audio_at = written_at = 0.0

    async def listen(ws: Any) -> None:
        nonlocal first_audio_at
        async for m in ws:
            if isinstance(m, bytes):
                pcm.extend(m)
                first_audio_at = first_audio_at or time.monotonic()
            elif (ev := json.loads(m))["type"] == "session.done":
                return
            else:
                events.append(ev)

    async with (
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as llm,
        websockets.connect(ws_url) as ws,
    ):
        await ws.send(json.dumps({"type": "session.config", "voice": "joe"}))
        listening = asyncio.create_task(listen(ws))
        asked_at = time.monotonic()
        answer = await llm.chat.completions.create(
            model="voice", messages=[{"role": "user", "content": "Why is the sky blue?"}],
            stream=True, max_tokens=96, seed=3,
        )  # fmt: skip
        async for chunk in answer:
            if chunk.choices and (delta := chunk.choices[0].delta.content):
                said += delta
                await ws.send(json.dumps({"type": "input.text", "text": delta}))
        written_at = time.monotonic()
        await ws.send(json.dumps({"type": "input.done"}))
        await asyncio.wait_for(listening, 120)
    print(f"first audio {first_audio_at - asked_at:.2f} s after the question, the answer "
          f"written {written_at - asked_at:.2f} s after it, {len(pcm) / 48_000:.1f} s of speech")  # fmt: skip
    assert [e["type"] for e in events if e["type"] == "error"] == []
    starts = [e for e in events if e["type"] == "audio.start"]
    assert len(starts) > 1 and "".join(e["sentence_text"] for e in starts) == said.rstrip()
    heard = await asyncio.to_thread(
        lambda: openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused").audio.transcriptions
        .create(model="transcribe", file=("answer.wav", wav_bytes(bytes(pcm), 24_000)))
    )  # fmt: skip
    assert said.strip() and wer(said, heard.text) <= 0.35, (said, heard.text)


def test_speech_in_a_voice_is_transcribed_back_to_its_words(
    client: openai.OpenAI, tmp_path: Path
) -> None:
    speech = client.audio.speech.create(
        model="speak", input=SENTENCE, voice="joe", response_format="wav"
    )
    rate, frames = wav_frames(speech.content)
    assert frames / rate > 1.5, (rate, frames)  # a dozen words take seconds to say
    path = tmp_path / "speech.wav"
    path.write_bytes(speech.content)
    with path.open("rb") as f:
        heard = client.audio.transcriptions.create(model="transcribe", file=f, language="en")
    assert wer(SENTENCE, heard.text) <= 0.35, heard.text
    with pytest.raises(openai.BadRequestError) as refused:  # not heard as wrong English
        client.audio.transcriptions.create(
            model="transcribe", file=("speech.wav", speech.content), language="fr"
        )
    assert refused.value.code == "unsupported_language", refused.value

    faster = client.audio.speech.create(
        model="speak", input=SENTENCE, voice="joe", speed=1.5, response_format="wav"
    )
    assert wav_frames(faster.content)[1] < 0.85 * frames
    # OpenAI's voice names, which piper does not have, speak in piper's default voice
    marin = client.audio.speech.create(
        model="speak", input=SENTENCE, voice="marin", response_format="wav"
    )
    # (piper's sampling noise moves a sentence's length by a few per cent: 5.2 % seen)
    assert wav_frames(marin.content)[1] == pytest.approx(frames, rel=0.12)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac"])
def test_speech_as_mp3_opus_or_flac_is_transcribed_back_to_its_words(
    client: openai.OpenAI, fmt: Literal["mp3", "opus", "flac"]
) -> None:
    """OpenAI's own formats (its speech default is mp3), out and back in: piper speaks at
    22.05 kHz, which Opus lacks (24 kHz then); pocketsphinx hears what the door decoded.
    MP3 and Opus stream as they are encoded; a FLAC comes whole, its sizes known."""
    with client.audio.speech.with_streaming_response.create(
        model="speak", input=SENTENCE, voice="joe", response_format=fmt
    ) as speech:
        streamed = "content-length" not in speech.headers
        assert streamed == (fmt != "flac"), speech.headers
        data = speech.read()
    audio, rate = soundfile.read(io.BytesIO(data))
    assert rate == (24000 if fmt == "opus" else 22050) and len(audio) / rate > 1.5, rate
    heard = client.audio.transcriptions.create(model="transcribe", file=(f"speech.{fmt}", data))
    assert wer(SENTENCE, heard.text) <= 0.35, heard.text


def test_speech_is_transcribed_with_the_times_of_its_words_and_as_subtitles(
    client: openai.OpenAI,
) -> None:
    """`verbose_json` with word and segment times, as the official client asks for them,
    and `srt`: pocketsphinx's word times, in the recording's time."""
    speech = client.audio.speech.create(
        model="speak", input=f"{SENTENCE} {SENTENCE}", voice="joe", response_format="wav"
    )
    rate, frames = wav_frames(speech.content)
    heard = client.audio.transcriptions.create(
        model="transcribe", file=("speech.wav", speech.content), response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )  # fmt: skip
    assert heard.duration == pytest.approx(frames / rate, abs=0.01)
    assert wer(f"{SENTENCE} {SENTENCE}", heard.text) <= 0.35, heard.text
    words = heard.words or []
    assert " ".join(w.word for w in words) == heard.text
    assert all(0 <= w.start < w.end <= heard.duration for w in words), words
    assert [w.start for w in words] == sorted(w.start for w in words)
    segments = heard.segments or []
    assert "".join(s.text for s in segments).strip() == heard.text
    srt = client.audio.transcriptions.create(
        model="transcribe", file=("speech.wav", speech.content), response_format="srt"
    )
    assert str(srt).startswith("1\n00:00:0"), srt
    assert wer(f"{SENTENCE} {SENTENCE}", " ".join(str(srt).split("\n")[2::4])) <= 0.35, srt


def test_speech_as_server_sent_events_is_transcribed_back_to_its_words(
    client: openai.OpenAI,
) -> None:
    """`stream_format: "sse"`, as OpenAI's gpt-4o-mini-tts streams: MP3 pieces in
    `speech.audio.delta` events, as they are encoded, then `speech.audio.done`."""
    with client.audio.speech.with_streaming_response.create(
        model="speak", input=SENTENCE, voice="joe", response_format="mp3", stream_format="sse"
    ) as speech:
        assert speech.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in speech.iter_lines() if line[:6] == "data: "]
    *deltas, done = events
    assert {d["type"] for d in deltas} == {"speech.audio.delta"} and len(deltas) >= 2
    assert done["type"] == "speech.audio.done" and done["usage"]["input_tokens"] > 0
    data = b"".join(base64.b64decode(d["audio"]) for d in deltas)
    heard = client.audio.transcriptions.create(model="transcribe", file=("speech.mp3", data))
    assert wer(SENTENCE, heard.text) <= 0.35, heard.text


def test_a_streamed_transcription_comes_as_openais_text_events(client: openai.OpenAI) -> None:
    """The official client's `stream=True`: its typed events, the pieces joined being the
    whole text, which is what was said."""
    recording = wav_bytes(speech(SENTENCE), RATE)
    events = list(
        client.audio.transcriptions.create(
            model="transcribe", file=("said.wav", recording), stream=True
        )
    )
    *deltas, done = events
    assert done.type == "transcript.text.done" and deltas, events
    assert all(d.type == "transcript.text.delta" for d in deltas)
    assert "".join(d.delta for d in deltas) == done.text  # type: ignore[union-attr]
    assert wer(SENTENCE, done.text) <= 0.35, done.text


def test_speech_refuses_a_pipeline_that_would_answer_instead_and_an_unknown_voice(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.speech.create(model="voice", input="Hi", voice="joe")
    assert "answers its input" in str(bad.value)
    with pytest.raises(openai.APIError) as unknown:
        client.audio.speech.create(model="speak", input="Hi", voice="nobody", response_format="wav")
    assert "nobody" in str(unknown.value)


def test_a_spoken_question_in_a_chat_is_answered_aloud_knowing_the_turns_before(
    client: openai.OpenAI,
) -> None:
    """As OpenAI's audio chat models take speech: an `input_audio` part. Speech without
    piper's sampling noise, heard the same way each run, and greedy sampling: the answer
    naming the word only the text turn said has one outcome."""
    question = wav_bytes(speech("What word did I ask you to remember?"), RATE)
    heard: ChatCompletionContentPartInputAudioParam = {
        "type": "input_audio",
        "input_audio": {"data": b64(question), "format": "wav"},
    }
    whole = client.chat.completions.create(
        model="listen",
        messages=[
            {"role": "user", "content": "Remember the word banana."},
            {"role": "assistant", "content": "I will remember the word banana."},
            {"role": "user", "content": [heard]},
        ],
        modalities=["text", "audio"],
        audio={"format": "wav", "voice": "joe"},
        temperature=0,
        max_tokens=48,
    )
    message = whole.choices[0].message
    assert message.content and "banana" in message.content.lower(), message.content
    assert message.audio is not None
    rate, frames = wav_frames(base64.b64decode(message.audio.data))
    assert frames / rate > 0.5, (rate, frames)


def test_an_answer_cut_at_max_tokens_says_length_and_the_models_token_counts(
    client: openai.OpenAI,
) -> None:
    """As OpenAI's: a client tells a whole answer from one cut short by `finish_reason`, and
    `usage` is the model's count: the 8 words asked about and, before them, voice.yaml's
    system prompt in SmolLM2's chat template (the front door's estimate would be 8); the
    same prompt again is read from llama.cpp's cache (`cached_tokens`)."""
    ask: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me a long story about a dragon."}
    ]
    whole = client.chat.completions.create(model="voice", messages=ask, max_tokens=4)
    assert whole.choices[0].finish_reason == "length", whole
    assert whole.usage is not None and whole.usage.completion_tokens == 4, whole.usage
    assert whole.usage.prompt_tokens > 30, whole.usage
    stream = client.chat.completions.create(
        model="voice",
        messages=ask,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [r for r in reasons if r is not None] == ["length"], reasons
    again = chunks[-1].usage
    assert again is not None and (again.prompt_tokens, again.completion_tokens) == (
        whole.usage.prompt_tokens, 4,
    )  # fmt: skip
    # the same prompt again: llama.cpp had its state, and says so
    assert again.prompt_tokens_details is not None, again
    assert (again.prompt_tokens_details.cached_tokens or 0) >= again.prompt_tokens // 2, again
    said = client.chat.completions.create(
        model="voice", messages=[{"role": "user", "content": "What is 2+2?"}], temperature=0
    )
    assert said.choices[0].finish_reason == "stop", said.choices[0].message.content


def test_a_conversation_longer_than_the_context_is_the_clients_error(client: openai.OpenAI) -> None:
    """A 400 with OpenAI's code for it, which the client does not retry (a 502 it would),
    streamed or not."""
    turns: list[ChatCompletionMessageParam] = []
    for i in range(60):
        turns += [
            {"role": "user", "content": f"Tell me fact number {i} about the ocean."},
            {"role": "assistant", "content": "The ocean covers most of the Earth's surface."},
        ]
    turns.append({"role": "user", "content": "And one more?"})
    for stream in (False, True):  # streamed too: the refusal comes before any output
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="voice", messages=turns, max_tokens=8, stream=stream
            )
        assert refused.value.code == "context_length_exceeded", refused.value
        assert "more than the model's context of 1024 tokens" in str(refused.value)
    many: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi."}] * 300
    with pytest.raises(openai.BadRequestError) as refused:  # more turns than llama.cpp takes
        client.chat.completions.create(model="voice", messages=many, max_tokens=8)
    assert "at most 256 items" in str(refused.value)


def test_the_responses_api_answers_streams_parses_and_calls(client: openai.OpenAI) -> None:
    """`/v1/responses` with the client's own helpers: a streamed answer gathered by its
    `stream()` (which checks the events' order and items), an answer parsed into a pydantic
    model (`text_format`, a strict schema), and a required call of a strict function."""
    with client.responses.stream(
        model="voice", input="Why is the sky blue?", max_output_tokens=32, temperature=0
    ) as stream:
        events = list(stream)
    deltas = [ev.delta for ev in events if ev.type == "response.output_text.delta"]
    ended = events[-1]  # `response.incomplete` at the token limit, as OpenAI's
    assert ended.type in ("response.completed", "response.incomplete"), ended.type
    final = ended.response
    print(f"streamed {final.output_text!r} ({final.status}, {final.usage})")
    assert final.status == ended.type.removeprefix("response.") and len(deltas) > 3
    assert final.output_text == "".join(deltas) and final.output_text.strip()
    assert final.usage is not None and final.usage.output_tokens == len(deltas)
    parsed = client.responses.parse(
        model="voice", input="Describe a person named Ada who is 36.", text_format=Person,
        max_output_tokens=128, temperature=0,
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, Person), parsed.output_text
    tool: Any = {"type": "function", **openai.pydantic_function_tool(GetWeather)["function"]}
    asked = client.responses.create(
        model="voice", input="What is the weather like in Paris today?", tools=[tool],
        tool_choice="required",
    )  # fmt: skip
    calls = [item for item in asked.output if item.type == "function_call"]
    print(f"called {[(c.name, c.arguments) for c in calls]}")
    assert calls and calls[0].name == "GetWeather"
    assert GetWeather.model_validate_json(calls[0].arguments).city.strip()


def test_a_response_goes_on_from_the_one_before_it(client: openai.OpenAI) -> None:
    """`previous_response_id` and `conversation` on the real models: the second answer
    knows what only the first turn said, which the same question alone does not (greedy
    sampling: one outcome each), streamed by the client's helper; the conversation holds
    the turn it answered."""
    first = client.responses.create(
        model="voice", input="Remember the word banana.", max_output_tokens=32, temperature=0
    )
    with client.responses.stream(
        model="voice", input="What word did I ask you to remember?", max_output_tokens=32,
        temperature=0, previous_response_id=first.id,
    ) as stream:  # fmt: skip
        second = stream.get_final_response()
    alone = client.responses.create(
        model="voice", input="What word did I ask you to remember?", max_output_tokens=32,
        temperature=0, store=False,
    )  # fmt: skip
    print(f"{first.output_text!r} → {second.output_text!r}; alone: {alone.output_text!r}")
    assert "banana" in second.output_text.lower(), second.output_text
    assert "banana" not in alone.output_text.lower(), alone.output_text  # it came from before
    assert client.responses.retrieve(second.id).output_text == second.output_text
    conv = client.conversations.create(items=[
        {"type": "message", "role": "user", "content": "Remember the word banana."},
        {"type": "message", "role": "assistant", "content": first.output_text},
    ])  # fmt: skip
    third = client.responses.create(
        model="voice", input="What word did I ask you to remember?", max_output_tokens=32,
        temperature=0, conversation=conv.id,
    )  # fmt: skip
    assert third.output_text == second.output_text  # the same conversation, read from Redis
    listed: list[Any] = [
        item.to_dict() for item in client.conversations.items.list(conv.id, order="asc")
    ]
    assert [item["role"] for item in listed] == ["user", "assistant", "user", "assistant"]
    assert listed[-1]["content"][0]["text"] == third.output_text


async def test_a_transcription_session_asked_for_when_connecting_transcribes_each_turn(
    server: ServeProcess,
) -> None:
    """`?intent=transcription`, as OpenAI's clients open one: committed turns, each
    transcribed by the `transcribe` pipeline, or failed with the stage's error; a pipeline
    that cannot transcribe is refused."""
    oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    intent: Any = {"intent": "transcription"}
    async with oai.realtime.connect(model="transcribe", extra_query=intent) as conn:
        created: Any = await recv(conn)
        assert created.session.type == "transcription", created
        await conn.session.update(session={
            "type": "transcription", "audio": {"input": {"turn_detection": None}}})  # fmt: skip
        assert (await recv(conn)).type == "session.updated"
        heard = []
        for words in (SENTENCE, "Please call me back tomorrow morning."):
            pcm = speech(words)
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
            await conn.input_audio_buffer.commit()
            while (ev := await asyncio.wait_for(recv(conn), 60)).type != (
                "conversation.item.input_audio_transcription.completed"
            ):
                pass
            heard.append((words, ev.transcript))
        # a language the stage does not hear: that turn's transcription fails, and says why
        await conn.session.update(session={"type": "transcription", "audio": {"input": {
            "transcription": {"language": "fr"}}}})  # fmt: skip
        assert (await recv(conn)).type == "session.updated"
        await conn.input_audio_buffer.append(audio=base64.b64encode(speech("Bonjour.")).decode())
        await conn.input_audio_buffer.commit()
        while not (ev := await asyncio.wait_for(recv(conn), 60)).type.endswith("failed"):
            pass
    print(heard)
    assert all(wer(said, got) <= 0.35 for said, got in heard), heard
    assert ev.type == "conversation.item.input_audio_transcription.failed", ev
    assert ev.error.code == "unsupported_language", ev.error
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with oai.realtime.connect(model="voice", extra_query=intent):
            pass
    assert refused.value.response.status_code == 400
