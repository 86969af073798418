"""What the command line sends and prints: the prompt (text, or a recording for a pipeline
that hears), then the outputs as they stream, a summary, the audio file."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_runtime.core.types import OrchOutput
from omni_runtime.errors import ConfigError

if TYPE_CHECKING:
    from omni_runtime.pipeline import PipelineConfig


def _is_audio(data: Any) -> bool:
    return hasattr(data, "dtype") and hasattr(data, "shape")


class OutputPrinter:
    """Prints outputs as they stream; keeps audio chunks for `--wav`; times the request.

    Time to first token is the first non-audio output, time to first audio the first
    array; both are measured from the submit, as a user would feel them.
    """

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.audio: list[Any] = []
        self.failed = False
        self.started = time.monotonic()
        self.first_token_s: float | None = None
        self.first_audio_s: float | None = None
        self.end_s: float | None = None
        self.cut: list[int] = []
        """Stages whose output stopped at its limit (`max_tokens`), not where it ended."""

    def restart_clock(self) -> None:
        self.started = time.monotonic()

    def __call__(self, out: OrchOutput) -> None:
        elapsed_s = time.monotonic() - self.started
        self.end_s = elapsed_s
        if out.error is not None:
            self.failed = True
            print(
                f"[{elapsed_s * 1000:7.1f} ms] stage {out.stage_id} ERROR: {out.error}",
                file=sys.stderr,
            )
            return
        data = out.data
        if _is_audio(data):
            self.audio.append(data)
            self.first_audio_s = self.first_audio_s if self.first_audio_s is not None else elapsed_s
            desc = f"audio chunk {data.shape[0]} samples ({data.dtype})"
        else:
            if self.first_token_s is None and data not in ("", None):  # "": heard no words
                self.first_token_s = elapsed_s
            desc = repr(data)
        if out.finish_reason == "length":
            self.cut.append(out.stage_id)
        if not self.quiet:
            end = "  (finished)" if out.finished else ""
            end += "  (stopped at max_tokens)" if out.finish_reason == "length" else ""
            print(f"[{elapsed_s * 1000:7.1f} ms] stage {out.stage_id}: {desc}{end}", flush=True)

    def summary(self) -> str:
        """One line: time to first token, to first audio, end to end."""

        def fmt(value_s: float | None) -> str:
            if value_s is None:
                return "-"
            return f"{value_s * 1000:.0f} ms" if value_s < 1 else f"{value_s:.2f} s"

        cut = "".join(f" · stage {s} stopped at max_tokens" for s in self.cut)
        return (
            f"TTFT {fmt(self.first_token_s)} · TTFP {fmt(self.first_audio_s)} · "
            f"E2E {fmt(self.end_s)}{' (failed)' if self.failed else ''}{cut}"
        )


def check_wav_path(path: str | None) -> None:
    """Fail before the run, not after it: the directory must exist and be writable."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"--wav {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--wav {path}: directory {parent} is not writable")


def write_wav(printer: OutputPrinter, path: str | None, sample_rate: int) -> None:
    if path is None:
        return
    from omni_runtime.wav import write_wav as write

    frames = write(path, printer.audio, sample_rate)
    print(f"wrote {path}: {frames} frames, {frames / sample_rate:.2f} s at {sample_rate} Hz")


def parse_params(pairs: list[str]) -> dict[str, Any] | None:
    """`--param KEY=VALUE`s as the request's parameters: each value JSON where it parses
    (`40`, `0.2`, `["."]`), else the text as given (`joe`); the stages check them."""
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--param {pair!r}: expected KEY=VALUE")
        try:
            params[key.strip()] = json.loads(raw)
        except ValueError:
            params[key.strip()] = raw
    return params or None


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from the argument, `-` (stdin) or `--prompt-file` (any size): UTF-8 text
    that is not empty, else a `ConfigError` before anything starts."""
    if prompt is not None and prompt_file is not None:
        raise ConfigError("give the prompt as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        where = "stdin" if prompt_file == "-" else f"--prompt-file {prompt_file}"
        text = _utf8(_read_stdin() if prompt_file == "-" else _read_file(prompt_file), where)
    elif prompt == "-":
        text = _utf8(_read_stdin(), "stdin")
    elif prompt is None:
        raise ConfigError("no prompt: pass it as an argument, '-' for stdin, or --prompt-file")
    else:
        text = prompt
    if not text.strip():
        raise ConfigError("the prompt is empty: give the pipeline something to say")
    return text


def read_input(pipeline: PipelineConfig, prompt: str | None, prompt_file: str | None) -> Any:
    """What stage 0 is sent: the prompt's text (`read_prompt`), or for a pipeline that hears
    (`outputs.input: audio`) the recording `--prompt-file` names, as a WAV (MP3, FLAC and
    Ogg are decoded) in `{"wav": bytes}` (what `/v1/audio/transcriptions` sends it), or,
    if it takes text turns too (`outputs.text_turns`), the prompt's text as a turn with
    nothing to hear; a `ConfigError` before anything starts."""
    if pipeline.outputs is None or pipeline.outputs.input != "audio":
        return read_prompt(prompt, prompt_file)
    if prompt_file is None and prompt is not None and pipeline.outputs.text_turns:
        return {"wav": None, "messages": [{"role": "user", "content": read_prompt(prompt, None)}]}
    if prompt_file is None:
        raise ConfigError(
            f"pipeline {pipeline.name!r} takes speech: give a WAV or MP3 file with --prompt-file "
            "(--prompt-file - reads it from stdin)"
        )
    if prompt is not None:
        raise ConfigError("give the prompt as an argument or with --prompt-file, not both")
    from omni_runtime.wav import WavError, recording  # numpy: not before a command needs it

    where = "stdin" if prompt_file == "-" else f"--prompt-file {prompt_file}"
    try:
        return {"wav": recording(_read_stdin() if prompt_file == "-" else _read_file(prompt_file))}
    except WavError as e:
        raise ConfigError(f"{where}: {e}") from None


def _read_file(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"--prompt-file {path}: {e.strerror}") from e


def _read_stdin() -> bytes:
    """Bytes, not text: Python decodes stdin with `surrogateescape` in some locales, and the
    surrogates would fail only when the request is encoded, after every process started."""
    return sys.stdin.buffer.read()


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where}: the prompt is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
            f"{e.start})"
        ) from None
