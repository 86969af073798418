"""The speech engines on this machine: speed (real-time factor, time to first chunk) and
intelligibility (pocketsphinx's word error rate on what they say). Figures for docs/engines.md.

Each TTS runs as its stages would in a worker: the piper talker on a thread filling a
`ChunkStream` that the piper vocoder reads (streaming mode), espeak-ng as its one stage.
The whole text is there at the start (as `/v1/audio/speech` gives it), in token-sized
deltas. Time to first chunk: start -> the first PCM chunk out of the last stage; real-time
factor: start -> the last chunk, over the seconds of audio made. flite (Debian CLI, one
process per sentence) is the intelligibility baseline when installed.

    python3 -m benchmarks.speech_engines [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from omni_runtime.engines import espeak, piper, pocketsphinx
from omni_runtime.engines.wer import wer
from omni_runtime.stage_api import ChunkStream, Final

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back when you get home tonight.",
    "The weather today is sunny and warm, with a light breeze from the west.",
    "I would like a cup of coffee and a piece of cake, please.",
    "We will meet at the train station at noon tomorrow.",
]
PARAGRAPH = " ".join(SENTENCES)
RATE = 22_050
Pcm = npt.NDArray[np.float32]
Synth = Callable[[str], Iterator[Any]]


def token_deltas(text: str) -> list[str]:
    """The text as an LLM streams it: word pieces with their leading space, marks apart."""
    return re.findall(r" ?\w{1,4}|[^\w ]| ", text)


def piper_chain(text: str, num_threads: int = 1) -> Iterator[Any]:
    """Talker on its own thread, feeding the vocoder through a ChunkStream."""
    ids = ChunkStream()

    def talk() -> None:
        for chunk in piper.talker(token_deltas(text)):
            last = isinstance(chunk, Final)
            ids.extend([chunk.data if last else chunk], closed=last)

    thread = threading.Thread(target=talk, daemon=True)
    thread.start()
    yield from piper.vocoder(ids, num_threads=num_threads)
    thread.join()


def espeak_chain(text: str) -> Iterator[Any]:
    return espeak.vocoder(token_deltas(text))


def timed(synth: Synth, text: str) -> tuple[float, float, Pcm]:
    """(time to first chunk, total time, audio) of one request."""
    start = time.perf_counter()
    first: float | None = None
    parts: list[Pcm] = []
    for out in synth(text):
        pcm = out.data if isinstance(out, Final) else out
        if first is None and pcm.size:
            first = time.perf_counter() - start
        parts.append(pcm)
    total = time.perf_counter() - start
    return first or total, total, np.concatenate(parts)


def speed_row(name: str, synth: Synth, runs: int) -> str:
    timed(synth, SENTENCES[0])  # warm: the voice is loaded, onnxruntime's arena sized
    firsts, rtfs, audio_s = [], [], 0.0
    for _ in range(runs):
        first, total, pcm = timed(synth, PARAGRAPH)
        audio_s = pcm.size / RATE
        firsts.append(first * 1000)
        rtfs.append(total / audio_s)
    return (
        f"| {name} | {audio_s:.1f} | {statistics.median(firsts):.1f} "
        f"({min(firsts):.1f}-{max(firsts):.1f}) | {statistics.median(rtfs):.3f} "
        f"({min(rtfs):.3f}-{max(rtfs):.3f}) |"
    )


def concurrent_rtf(synth: Synth, requests: int) -> float:
    """Wall time of `requests` requests at once over the audio they make together."""
    start = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        results = list(pool.map(lambda _: timed(synth, PARAGRAPH), range(requests)))
    wall = time.perf_counter() - start
    return wall / sum(r[2].size / RATE for r in results)


def flite_pcm(text: str, voice: str) -> Pcm:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.wav"
        subprocess.run(["flite", "-voice", voice, "-t", text, "-o", str(path)], check=True)
        pcm, rate = pocketsphinx.read_wav(path.read_bytes())
    return pocketsphinx.resample(pcm, rate, RATE)


def heard_wer(pcm: Pcm, text: str) -> tuple[float, float]:
    """(word error rate, recognition time / audio time)."""
    start = time.perf_counter()
    heard = pocketsphinx.transcribe({"pcm": pcm, "sample_rate": RATE})
    return wer(text, heard), (time.perf_counter() - start) / (pcm.size / RATE)


def wer_row(name: str, speak: Callable[[str], Pcm], runs: int) -> tuple[str, list[float]]:
    sentence_wers = [[heard_wer(speak(s), s)[0] for _ in range(runs)] for s in SENTENCES]
    paragraph = [heard_wer(speak(PARAGRAPH), PARAGRAPH) for _ in range(runs)]
    per = " / ".join(f"{statistics.mean(w):.2f}" for w in sentence_wers)
    whole = [w for w, _ in paragraph]
    return (
        f"| {name} | {per} | {statistics.mean(whole):.2f} ({min(whole):.2f}-{max(whole):.2f}) |",
        [r for _, r in paragraph],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    print(f"cores: {os.cpu_count()}, load average at start: {os.getloadavg()[0]:.2f}\n")

    start = time.perf_counter()
    piper.load_voice(with_session=True)
    print(f"piper voice load (ONNX session): {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    espeak.get_espeak()
    print(f"espeak-ng initialise: {(time.perf_counter() - start) * 1000:.1f} ms\n")

    print("| engine | audio s | first chunk ms, median (range) | RTF, median (range) |")
    print("| --- | --- | --- | --- |")
    print(speed_row("piper talker + vocoder", piper_chain, runs))
    print(speed_row("piper, 2 onnxruntime threads", lambda t: piper_chain(t, 2), runs))
    print(speed_row("espeak-ng", espeak_chain, runs))
    for c in (2, 4):
        print(
            f"piper at c = {c}: RTF of the audio made together {concurrent_rtf(piper_chain, c):.3f}"
        )
        print(f"espeak-ng at c = {c}: {concurrent_rtf(espeak_chain, c):.4f}")

    def piper_pcm(text: str) -> Pcm:
        return timed(piper_chain, text)[2]

    def espeak_pcm(text: str) -> Pcm:
        return timed(espeak_chain, text)[2]

    engines: list[tuple[str, Callable[[str], Pcm], int]] = [
        ("piper (en_US-joe-medium)", piper_pcm, runs),
        ("espeak-ng (en-us)", espeak_pcm, runs),  # varies a little from call to call too
    ]
    if shutil.which("flite"):
        engines += [
            ("flite kal16", lambda t: flite_pcm(t, "kal16"), 1),  # deterministic
            ("flite slt", lambda t: flite_pcm(t, "slt"), 1),
        ]
    print("\n| engine | WER per sentence (mean) | WER of the paragraph, mean (range) |")
    print("| --- | --- | --- |")
    recognition: list[float] = []
    for name, speak, n in engines:
        row, rtfs = wer_row(name, speak, n)
        recognition += rtfs
        print(row)
    print(f"\npocketsphinx recognition RTF: median {statistics.median(recognition):.2f}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
