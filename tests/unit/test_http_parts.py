"""The HTTP front end's pure parts: settings, audio encoding, request schemas, `outputs`."""

from __future__ import annotations

import importlib.util
import io
import json
import signal
import sys
import wave
from typing import Any

import numpy as np
import pytest
import soundfile
import uvicorn
from pydantic import ValidationError

from omni_runtime.cli import parse_args
from omni_runtime.cli.console import read_input
from omni_runtime.errors import ConfigError
from omni_runtime.http.audio import (
    AudioFormatError,
    EncodedStream,
    FileFormat,
    as_pcm,
    audio_file,
    pcm16,
    unencodable,
    wav_bytes,
    wav_header,
)
from omni_runtime.http.gateway import check_served
from omni_runtime.http.schemas import ChatCompletionRequest
from omni_runtime.http.serve import DrainingServer, pipeline_paths
from omni_runtime.http.settings import ServeSettings
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.wav import WavError, recording, whole_wav
from tests.integration.http_support import pipeline_of


def test_api_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_API_KEYS", " first-key-1, second-key-2 ,")
    keys = ServeSettings().api_keys
    assert [k.get_secret_value() for k in keys] == ["first-key-1", "second-key-2"]
    assert "first-key-1" not in repr(ServeSettings())
    monkeypatch.setenv("OMNI_API_KEYS", "short")
    with pytest.raises(ValidationError):
        ServeSettings()


def test_cors_origins_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_CORS_ORIGINS", "https://app.example, http://localhost:3000,")
    assert ServeSettings().cors_origins == ["https://app.example", "http://localhost:3000"]
    monkeypatch.setenv("OMNI_CORS_ORIGINS", "http://[::1]:8080,*")
    assert ServeSettings().cors_origins == ["http://[::1]:8080", "*"]
    for bad in ("app.example", "https://app.example/", "https://app.example/path", "file://x"):
        monkeypatch.setenv("OMNI_CORS_ORIGINS", bad)
        with pytest.raises(ConfigError, match=r"OMNI_CORS_ORIGINS: .* is not an origin"):
            ServeSettings.load()


@pytest.mark.parametrize(
    ("host", "keys", "allow", "ok"),
    [
        ("127.0.0.1", "", False, True),
        ("localhost", "", False, True),
        ("::1", "", False, True),
        ("0.0.0.0", "", False, False),
        ("0.0.0.0", "a-long-key-1", False, True),
        ("0.0.0.0", "", True, True),
    ],
)
def test_no_open_server_without_keys(host: str, keys: str, allow: bool, ok: bool) -> None:
    settings = ServeSettings.model_validate(
        {"host": host, "api_keys": keys, "allow_unauthenticated": allow}
    )
    if ok:
        settings.check_exposure()
    else:
        with pytest.raises(ConfigError, match="--allow-unauthenticated"):
            settings.check_exposure()


def test_pcm16_clips_and_is_little_endian() -> None:
    data = pcm16(np.array([0.0, 1.0, -1.0, 2.0, np.nan], np.float32))
    assert np.frombuffer(data, "<i2").tolist() == [0, 32767, -32767, 32767, 0]


def test_whole_and_streaming_wav_headers_read_back() -> None:
    pcm = pcm16(np.linspace(-0.5, 0.5, 800, dtype=np.float32))
    for blob in (wav_bytes(pcm, 16000), wav_header(16000) + pcm):
        with wave.open(io.BytesIO(blob)) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
            assert w.readframes(1 << 20) == pcm


@pytest.mark.parametrize("bad", ["text", None, [["a"]], np.zeros((2, 2, 2))])
def test_audio_outputs_must_be_numeric_pcm(bad: Any) -> None:
    with pytest.raises(AudioFormatError):
        as_pcm(bad)


def test_prompt_is_the_last_user_message() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "omni",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "ok"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "se"}, {"type": "text", "text": "cond"}],
                },
            ],
            "temperature": 0.2,  # a parameter for the stages, not part of the prompt
            "logprobs": True,  # accepted and ignored, like other OpenAI knobs
        }
    )
    assert req.prompt == "second"
    assert req.params() == {"temperature": 0.2}
    assert not req.wants_audio
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "omni", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
        )


def pipeline(**outputs: Any) -> dict[str, Any]:
    return {
        "name": "p",
        "final_stage_ids": [0, 2],
        "stages": [{"id": i, "name": f"s{i}", "entry": "m:f"} for i in range(3)],
        "outputs": outputs,
    }


def test_outputs_name_final_stages() -> None:
    config = PipelineConfig.model_validate(pipeline(text_stage=0, audio_stage=2, sample_rate=24000))
    assert config.outputs is not None and config.outputs.sample_rate == 24000
    for bad in ({"text_stage": 1}, {"audio_stage": 5}, {}, {"text_stage": 0, "audio_stage": 0}):
        with pytest.raises(ValidationError):
            PipelineConfig.model_validate(pipeline(**bad))
    with pytest.raises(ValidationError):
        PipelineConfig.model_validate(pipeline(text_stage=0, sample_rate=0))


def test_outputs_say_what_stage_0_takes() -> None:
    default = PipelineConfig.model_validate(pipeline(text_stage=0)).outputs
    assert default is not None and default.input == "text"
    for taken in ("text", "chat", "audio"):
        config = PipelineConfig.model_validate(pipeline(text_stage=0, input=taken))
        assert config.outputs is not None and config.outputs.input == taken
    with pytest.raises(ValidationError, match="input"):
        PipelineConfig.model_validate(pipeline(text_stage=0, input="video"))
    hears = PipelineConfig.model_validate(pipeline(text_stage=0, input="audio", text_turns=True))
    assert hears.outputs is not None and hears.outputs.text_turns
    with pytest.raises(ValidationError, match="text_turns is for a pipeline whose input is audio"):
        PipelineConfig.model_validate(pipeline(text_stage=0, input="chat", text_turns=True))


def test_run_sends_text_to_a_pipeline_that_hears_only_if_it_takes_text_turns() -> None:
    hears = PipelineConfig.model_validate(pipeline(text_stage=0, input="audio", text_turns=True))
    turn = {"wav": None, "messages": [{"role": "user", "content": "Hello"}]}
    assert read_input(hears, "Hello", None) == turn
    deaf = PipelineConfig.model_validate(pipeline(text_stage=0, input="audio"))
    with pytest.raises(ConfigError, match="takes speech"):
        read_input(deaf, "Hello", None)


def test_serve_takes_pipelines_repeated_or_as_a_comma_list() -> None:
    args = parse_args(["serve", "--pipeline", "a.yaml", "--pipeline", "b.yaml, c.yaml"])
    assert pipeline_paths(args.pipeline) == ["a.yaml", "b.yaml", "c.yaml"]
    assert pipeline_paths(parse_args(["serve", "--pipeline", "a.yaml"]).pipeline) == ["a.yaml"]


@pytest.mark.parametrize(("second", "forced"), [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_the_first_stop_signal_asks_for_the_drain_a_second_shuts_down(
    second: int, forced: bool
) -> None:
    """The first holds uvicorn's shutdown back (Realtime responses finish first); a second
    begins it, and a second Ctrl-C ends it at once, as uvicorn's own does."""
    server = DrainingServer(uvicorn.Config(app="omni_runtime.http.app:create_app"))
    server.handle_exit(signal.SIGTERM, None)
    assert server.stop_requested and not server.should_exit
    server.handle_exit(second, None)
    assert server.should_exit and server.force_exit == forced


def test_an_upload_is_checked_and_rewritten_whole() -> None:
    pcm = np.arange(-400, 400, dtype="<i2").tobytes()
    whole = wav_bytes(pcm, 8000)
    assert whole_wav(whole) == whole
    streamed = wav_header(8000) + pcm  # sizes "until the end"
    assert whole_wav(streamed) == whole
    assert whole_wav(whole + b"\x01") == whole  # half a frame at the end is dropped
    for bad in (b"", b"RIFF", whole[:40], wav_bytes(b"", 8000), b"OggS" + whole[4:]):
        with pytest.raises(WavError):
            whole_wav(bad)
    with pytest.raises(WavError, match=r"sample rate is 1 Hz, outside 4000\.\.384000"):
        whole_wav(wav_bytes(pcm, 1))


def test_without_soundfile_other_formats_are_refused_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A WAV still goes through; a request for MP3 is refused before it runs."""
    monkeypatch.setitem(sys.modules, "soundfile", None)  # `import soundfile` fails
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "soundfile" else real_find_spec(n)
    )
    pcm = np.arange(-400, 400, dtype="<i2").tobytes()
    assert recording(wav_bytes(pcm, 8000)) == wav_bytes(pcm, 8000)
    with pytest.raises(WavError, match=r"need the soundfile package .*omni-runtime\[serve\]"):
        recording(b"ID3\x04 an mp3")
    with pytest.raises(WavError, match="not a PCM WAV file"):  # a float WAV: as before
        recording(b"RIFF" + bytes(40))
    assert unencodable("wav") is None
    assert "needs the soundfile package" in (unencodable("mp3") or "")
    assert audio_file(np.zeros(4, np.float32), 8000, "wav") == wav_bytes(bytes(8), 8000)


def test_a_compressed_answer_at_a_rate_its_format_lacks_is_resampled() -> None:
    """Opus has no 22.05 kHz (piper's rate): its answer goes at 24 kHz, as long."""
    tone = (0.3 * np.sin(np.arange(22050) / 5)).astype(np.float32)
    formats: list[tuple[FileFormat, int]] = [("opus", 24000), ("mp3", 22050), ("flac", 22050)]
    for fmt, rate in formats:
        decoded, decoded_rate = soundfile.read(io.BytesIO(audio_file(tone, 22050, fmt)))
        assert decoded_rate == rate, fmt
        assert abs(len(decoded) / rate - 1.0) < 0.11, (fmt, len(decoded))


def streamed(stream: EncodedStream, samples: np.ndarray) -> tuple[bytes, list[int]]:
    """`samples` through `stream` in uneven chunks: the bytes, and how many each chunk gave."""
    out, sizes = [], []
    for piece in np.array_split(samples, [700, 5000, 5001, 9000, 16000, 30000]):
        out.append(stream.encode(piece))
        sizes.append(len(out[-1]))
    out.append(stream.close())
    return b"".join(out), sizes


def test_an_opus_stream_decodes_to_the_audio_its_whole_file_holds() -> None:
    """Encoded as it comes (piper's 22.05 kHz resampled on the way), the same audio."""
    tone = (0.3 * np.sin(np.arange(33075) / 7)).astype(np.float32)
    data, sizes = streamed(EncodedStream(22050, "opus"), tone)
    assert sum(1 for n in sizes if n) >= 3  # bytes went out before the end
    decoded, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    whole, _ = soundfile.read(io.BytesIO(audio_file(tone, 22050, "opus")), dtype="float32")
    assert rate == 24000
    assert np.abs(decoded - whole).max() < 0.02 and abs(len(decoded) - len(whole)) <= 960


def test_an_mp3_stream_plays_its_audio_with_only_the_encoders_delay() -> None:
    """Its first frame, which libsndfile rewrites at the end, went out as it was first
    written: any decoder reads the stream to its end, the audio late by the encoder's delay."""
    rate = 22050
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(2 * rate) / rate)).astype(np.float32)
    data, sizes = streamed(EncodedStream(rate, "mp3"), tone)
    assert sizes[1] > 0 and sum(1 for n in sizes if n) >= 4
    decoded, decoded_rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert decoded_rate == rate
    delay = len(decoded) - len(tone)
    assert 0 <= delay <= 3 * 1152, delay  # priming, padding and the tag frame's silence
    best = max(
        range(delay + 1), key=lambda lag: float(np.dot(decoded[lag : lag + 4096], tone[:4096]))
    )
    aligned = decoded[best : best + len(tone)]
    error = np.sqrt(np.mean((aligned - tone) ** 2)) / np.sqrt(np.mean(tone**2))
    assert error < 0.1, (best, error)


def test_an_encoder_may_rewrite_what_has_not_gone_out_yet_and_nothing_else() -> None:
    from omni_runtime.http.audio import _Outgoing

    out = _Outgoing()
    out.write(b"headerBODY")
    out.seek(0)
    out.write(b"HEAD")  # not taken yet: rewritten
    out.seek(0, io.SEEK_END)
    assert out.take() == b"HEADerBODY"
    out.write(b"more")
    out.seek(2)
    out.write(b"xxxxxxxxXY")  # 8 bytes into what went out (dropped), 2 onto the pending
    assert out.tell() == 12
    out.seek(0, io.SEEK_END)
    assert out.take() == b"XYre"
    out.seek(100)
    with pytest.raises(OSError, match="past the end"):
        out.write(b"hole")


async def test_speech_events_end_with_the_error_that_cut_the_audio() -> None:
    """Once the headers went out, a failure is the last event (no `speech.audio.done`);
    a raw stream just ends, and a WAV due at the end is not sent half made."""
    from types import SimpleNamespace

    from omni_runtime.http.events import AudioEvent, Event, FailureEvent
    from omni_runtime.http.speech import _audio_bytes, _speech_events

    async def events() -> Any:
        yield AudioEvent(np.full(1600, 0.25, np.float32))
        yield FailureEvent("stage 2 failed: ValueError: boom")
        raise AssertionError("read past the failure")

    async def collect(source: Any) -> list[bytes]:
        return [piece async for piece in source]

    failed: list[Event] = []
    run = SimpleNamespace(usage=None)
    audio = _audio_bytes(events(), 16000, "pcm", failed)  # type: ignore[arg-type]
    body = b"".join(await collect(_speech_events(run, audio, failed, 3)))  # type: ignore[arg-type]
    blocks = [b.removeprefix(b"data: ") for b in body.strip().split(b"\n\n")]
    assert {json.loads(b).get("type") for b in blocks[:-1]} == {"speech.audio.delta"}
    assert json.loads(blocks[-1])["error"]["message"] == "stage 2 failed: ValueError: boom"
    failed.clear()
    raw = await collect(_audio_bytes(events(), 16000, "pcm", failed))  # type: ignore[arg-type]
    assert len(b"".join(raw)) == 2 * 2400 and len(failed) == 1  # 0.1 s at 24 kHz
    failed.clear()
    assert await collect(_audio_bytes(events(), 16000, "wav", failed)) == []  # type: ignore[arg-type]


def test_pipelines_served_together_need_names_that_fit_a_namespace() -> None:
    echo = pipeline_of("echo")
    assert check_served([echo], "omni") == ["omni"]
    assert check_served([echo, pipeline_of("transcribe")], "ns") == ["ns.echo", "ns.transcribe"]
    with pytest.raises(ConfigError, match="different names"):
        check_served([echo, pipeline_of("echo", input="text")], "ns")
    spaced = echo.model_copy(update={"name": "my echo"})
    with pytest.raises(ConfigError, match=r"namespace 'ns\.my echo'"):
        check_served([spaced, pipeline_of("transcribe")], "ns")
    bare = echo.model_copy(update={"outputs": None})
    with pytest.raises(ConfigError, match="no `outputs` field"):
        check_served([bare], "ns")
