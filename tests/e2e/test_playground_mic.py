"""The playground's microphone (its Talk panel, over `/v1/realtime`) in headless Chromium,
against `omni-runtime serve` on tests/pipelines/parrot.yaml: pocketsphinx hears, a parrot
answers with what it heard, piper speaks. Real speech in and out, without an LLM's wait.

The microphone is Chromium's fake device playing a WAV of a question piper spoke
(`--use-file-for-fake-audio-capture`): it starts when the page opens the microphone and
plays in a loop, so the question comes round again while the answer plays.
"""

from __future__ import annotations

import importlib.util
import re
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from omni_runtime.engines.wer import wer
from tests.e2e.chromium import chromium, keep
from tests.e2e.realtime_client import RATE, silence, speech
from tests.e2e.serving import ServeProcess
from tests.engines.speech import MAX_WER
from tests.services import unavailable

pytestmark = pytest.mark.timeout(180)

PARROT = "tests/pipelines/parrot.yaml"
QUESTION = "What is the weather like today?"
LEAD_MS, TAIL_MS = 600, 1000
"""Silence around the question: before it, for the page to start sending; after it, for the
server's VAD (500 ms) to hear its end and for the release of the button."""
WAIT_S = 60
STATE = ("state", "sent-ms", "playing", "turns", "completed", "barge-ins")
TIME = re.compile(r"^\d+ ms$|^\d+\.\d\d s$")


def question_wav(path: Path) -> float:
    """The question as piper says it, as a 24 kHz WAV with silence around; its length in ms."""
    if importlib.util.find_spec("pocketsphinx") is None:
        unavailable("pocketsphinx is not installed", "the pocketsphinx package")
    pcm = silence(LEAD_MS) + speech(QUESTION) + silence(TAIL_MS)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)
    return 1000 * len(pcm) / (2 * RATE)


def test_a_spoken_question_gets_a_spoken_transcribed_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wav = tmp_path / "question.wav"
    wav_ms = question_wav(wav)
    microphone = ("--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                  f"--use-file-for-fake-audio-capture={wav}")  # fmt: skip
    with (
        ServeProcess(tmp_path / "serve.log", "--pipeline", PARROT) as serve,
        chromium(tmp_path, monkeypatch, microphone) as browser,
    ):
        browser.get(serve.url + "/")
        wait = WebDriverWait(browser, WAIT_S, poll_frequency=0.05)
        wait.until(lambda d: d.find_element(By.ID, "status").text == "ready")
        panel = browser.find_element(By.ID, "talk-panel")
        talk = browser.find_element(By.ID, "talk")

        def state(name: str) -> int:
            return int(panel.get_attribute(f"data-{name}") or 0)

        def events() -> str:
            shown = {k: panel.get_attribute(f"data-{k}") for k in STATE}
            log = "\n".join(browser.execute_script("return window.talkEvents || []"))
            return f"{shown}\n{browser.find_element(By.ID, 'dialogue').text}\n{log}"

        def until(what: str, done: Callable[[], object]) -> None:
            try:
                wait.until(lambda _d: done())
            except TimeoutException:
                pytest.fail(f"{what}: not within {WAIT_S} s\n{events()}\n{serve.log()}")

        # Hold to talk: the press opens the microphone, which starts the file; the button is
        # held until the question has been said, and released before it comes round again.
        ActionChains(browser).click_and_hold(talk).perform()
        until("the question sent", lambda: state("sent-ms") >= wav_ms - TAIL_MS + 500)
        ActionChains(browser).release(talk).perform()
        # The answer plays as it streams.
        until("the answer", lambda: panel.get_attribute("data-playing") == "true" or state("turns"))
        assert panel.get_attribute("data-playing") == "true", f"{events()}\n{serve.log()}"

        # Talk freely over it: the question comes round, the server's VAD hears it start and
        # the page stops the answer; the server hears it end and answers it.
        browser.find_element(By.ID, "freetalk").click()
        until("speech over the answer", lambda: state("barge-ins") or state("turns") >= 2)
        assert state("barge-ins") >= 1, f"the question did not interrupt the answer\n{events()}"
        until("its end", lambda: panel.get_attribute("data-state") != "hearing")
        browser.find_element(By.ID, "freetalk").click()  # stop listening before it comes round

        def answered_freely() -> list[Any]:
            later = browser.find_elements(By.CSS_SELECTOR, "#dialogue .turn")[1:]
            return [t for t in later if t.get_attribute("data-status") == "completed"]

        until("the answer to the free turn", answered_freely)
        first = browser.find_element(By.CSS_SELECTOR, "#dialogue .turn")
        said = said_in(first)
        assert wer(QUESTION, said["you"]) <= MAX_WER, (said, events())
        assert said["model"].startswith(f"You said: {said['you']}."), said
        # interrupted while it played: the server cancelled it if it was still sending it
        assert "interrupted" in (first.get_attribute("class") or "").split()
        assert first.get_attribute("data-status") in {"completed", "cancelled"}
        assert int(first.get_attribute("data-audio-ms") or 0) > 0
        # and truncated where its playback stopped: the server took what the page heard
        truncated = first.get_attribute("data-truncated-ms")
        assert truncated is not None, f"no conversation.item.truncated\n{events()}"
        assert 0 <= int(truncated) <= int(first.get_attribute("data-audio-ms") or 0)
        # the free turn: the question (what of it the VAD took in) answered aloud
        free = answered_freely()[0]
        assert said_in(free)["model"].startswith("You said:"), events()
        assert int(free.get_attribute("data-audio-ms") or 0) >= 1000  # piper spoke it
        ttfa = [int(turn.get_attribute("data-ttfa-ms") or 0) for turn in (first, free)]
        print(f"time to first audio: held {ttfa[0]} ms, free {ttfa[1]} ms")
        for turn in (first, free):
            assert int(turn.get_attribute("data-ttfa-ms") or 0) > 0
            badge = turn.find_element(By.CSS_SELECTOR, ".badge").text
            assert TIME.match(badge.removeprefix("first audio ")), badge
        assert TIME.match(browser.find_element(By.ID, "talk-ttfa").text)
        assert int(browser.find_element(By.ID, "talk-barge-ins").text) >= 1
        browser.execute_script("arguments[0].scrollIntoView()", panel)
        keep(browser, tmp_path, "playground-talk.png")


def said_in(turn: Any) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    return {who: turn.find_element(By.CSS_SELECTOR, f".{who} .said").text
            for who in ("you", "model")}  # fmt: skip
