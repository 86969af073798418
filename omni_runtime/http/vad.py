"""Server VAD for `/v1/realtime`: where speech starts and stops in 24 kHz PCM16 input.

WebRTC's voice activity detector (PyPI `webrtcvad-wheels`, the `serve` extra) judges
each 20 ms frame at 16 kHz (input resampled with soxr); without it, an energy gate
does (a frame is voiced when its RMS is above a level set by `threshold`), which is
blind to what the sound is: any loud noise is speech to it. Either way a start needs
`START_FRAMES` voiced frames in a row and a stop `silence_duration_ms` of unvoiced
ones, as OpenAI's server VAD does.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

import numpy as np
import soxr

VAD_RATE = 16_000
FRAME_MS = 20
FRAME_SAMPLES = VAD_RATE * FRAME_MS // 1000
START_FRAMES = 3
"""60 ms of voiced frames in a row start speech: one loud click does not."""
DEFAULT_SILENCE_MS = 500
DEFAULT_PADDING_MS = 300
DEFAULT_THRESHOLD = 0.5

BACKEND: Literal["webrtcvad", "energy"] = (
    "webrtcvad" if importlib.util.find_spec("webrtcvad") is not None else "energy"
)


@dataclass(frozen=True, slots=True)
class Turn:
    """A VAD event: speech `started` or `stopped` at `ms` into the session's input audio."""

    kind: Literal["started", "stopped"]
    ms: int


class VoiceActivity:
    """Feed it input audio as it is appended; it says where speech starts and stops."""

    def __init__(
        self,
        threshold: float = DEFAULT_THRESHOLD,
        silence_ms: int = DEFAULT_SILENCE_MS,
        padding_ms: int = DEFAULT_PADDING_MS,
        input_rate: int = 24_000,
    ) -> None:
        self.padding_ms = padding_ms
        self._silence_frames = max(1, silence_ms // FRAME_MS)
        self._resampler = soxr.ResampleStream(input_rate, VAD_RATE, 1, dtype="int16")
        self._pending = np.zeros(0, np.int16)
        self._frames = 0
        """Frames judged so far: their count times FRAME_MS is where the audio is."""
        self._voiced_run = 0
        self._unvoiced_run = 0
        self.speaking = False
        if BACKEND == "webrtcvad":
            import webrtcvad

            self._vad = webrtcvad.Vad(min(3, int(threshold * 4)))  # 0.5 -> mode 2
        else:
            self._min_rms = 300.0 + 3000.0 * threshold  # int16 units: 0.5 -> ~-24 dBFS

    @property
    def heard_ms(self) -> int:
        """Input audio judged so far."""
        return self._frames * FRAME_MS

    def feed(self, pcm16: bytes) -> list[Turn]:
        """24 kHz PCM16 bytes, in order; the starts and stops they complete."""
        samples = self._resampler.resample_chunk(np.frombuffer(pcm16, "<i2"))
        self._pending = np.concatenate([self._pending, samples])
        turns: list[Turn] = []
        whole = self._pending.size - self._pending.size % FRAME_SAMPLES
        for start in range(0, whole, FRAME_SAMPLES):
            turn = self._judge(self._pending[start : start + FRAME_SAMPLES])
            if turn is not None:
                turns.append(turn)
        self._pending = self._pending[whole:]
        return turns

    def _voiced(self, frame: np.ndarray) -> bool:
        if BACKEND == "webrtcvad":
            return bool(self._vad.is_speech(frame.astype("<i2").tobytes(), VAD_RATE))
        return float(np.sqrt(np.mean(frame.astype(np.float64) ** 2))) >= self._min_rms

    def _judge(self, frame: np.ndarray) -> Turn | None:
        self._frames += 1
        voiced = self._voiced(frame)
        self._voiced_run = self._voiced_run + 1 if voiced else 0
        self._unvoiced_run = 0 if voiced else self._unvoiced_run + 1
        if not self.speaking and self._voiced_run >= START_FRAMES:
            self.speaking = True
            at = (self._frames - START_FRAMES) * FRAME_MS
            return Turn("started", at)
        if self.speaking and self._unvoiced_run >= self._silence_frames:
            self.speaking = False
            return Turn("stopped", (self._frames - self._unvoiced_run) * FRAME_MS)
        return None

    def reset(self) -> None:
        """Forget a speech in progress (the buffer was cleared or committed)."""
        self.speaking = False
        self._voiced_run = self._unvoiced_run = 0
