"""The official `openai` client against `omni-runtime serve` on the real models: a chat
answer streamed as text and speech, speech in a chosen voice, and that speech transcribed
back to its words (serve fronting workers/voice.yaml, speak.yaml and transcribe.yaml)."""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from omni_runtime.engines.wer import wer
from omni_runtime.local.launcher import redis_server_binary
from tests.e2e.serving import ServeProcess
from tests.e2e.test_real_voice import needs_engines  # noqa: F401 (a module-wide fixture)
from tests.services import unavailable

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_server]

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    if redis_server_binary() is None:
        unavailable("no redis-server on PATH", "a redis-server")
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    pipelines = "workers/voice.yaml,workers/speak.yaml,workers/transcribe.yaml"
    with ServeProcess(log, "--pipeline", pipelines, "--mode", "streaming") as serve:
        yield serve


@pytest.fixture
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


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


def test_speech_refuses_a_pipeline_that_would_answer_instead_and_an_unknown_voice(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.speech.create(model="voice", input="Hi", voice="joe")
    assert "answers its input" in str(bad.value)
    with pytest.raises(openai.APIError) as unknown:
        client.audio.speech.create(model="speak", input="Hi", voice="nobody", response_format="wav")
    assert "nobody" in str(unknown.value)
