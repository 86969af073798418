"""The playground page in headless Chromium against `omni-runtime serve` (embedded deployment).

Chromium as tests/e2e/chromium.py starts it (skipped without it, failed under CI=true).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.chromium import chromium, keep
from tests.e2e.serving import ServeProcess

pytestmark = pytest.mark.timeout(180)

PROMPT = "Hello from the playground, streaming text and audio!"


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    with chromium(tmp_path, monkeypatch) as driver:
        yield driver


def test_playground_streams_text_and_audio(browser: object, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import WebDriverWait

    assert isinstance(browser, WebDriver)
    # No --redis-url: serve starts its own Redis, orchestrator and workers, like `run`.
    with ServeProcess(tmp_path / "serve.log", "--pipeline", "workers/omni.yaml") as serve:
        browser.get(serve.url + "/")
        wait = WebDriverWait(browser, 60, poll_frequency=0.05)
        wait.until(lambda d: d.find_element(By.ID, "status").text == "ready")
        assert browser.find_element(By.ID, "model").text == "omni"
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys(PROMPT)
        browser.find_element(By.ID, "send").click()

        body = browser.find_element(By.TAG_NAME, "body")
        wait.until(lambda _d: body.get_attribute("data-state") in {"done", "error"})
        status = browser.find_element(By.ID, "status").text
        assert body.get_attribute("data-state") == "done", f"{status}\n{serve.log()}"
        text = browser.find_element(By.ID, "text").text
        assert text.startswith("Hello from the playground")
        chunks = int(body.get_attribute("data-audio-chunks") or 0)
        assert chunks == 10  # one audio chunk per token of PROMPT
        assert browser.find_element(By.ID, "chunks").text == str(chunks)
        for metric in ("ttft", "ttfa", "total"):
            assert browser.find_element(By.ID, metric).text.endswith(("ms", " s"))

        # streamed as produced: serve runs the demo in streaming mode unless told otherwise
        assert "(streaming mode)" in serve.log()
        assert int(body.get_attribute("data-first-audio-text") or 99) < 10  # before the text ended
        # replay and download: the answer as one WAV file, 24 kHz as the stream was
        player = browser.find_element(By.ID, "player")
        download = browser.find_element(By.ID, "download")
        assert player.is_displayed() and download.is_displayed()
        assert download.get_attribute("download") == "answer.wav"
        assert (download.get_attribute("href") or "").startswith("blob:")
        wait.until(
            lambda d: d.execute_script("return document.getElementById('player').duration > 0")
        )
        heard = float(browser.find_element(By.ID, "seconds").text.removesuffix(" s"))
        duration = browser.execute_script("return document.getElementById('player').duration")
        assert abs(duration - heard) < 0.02, (duration, heard)
        headings = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "section.panel h2")]
        assert headings == ["TIMING", "ANSWER", "AUDIO", "TALK"]  # shown upper-case
        assert "Ctrl+Enter sends" in browser.find_element(By.ID, "hint").text
        # the demo takes text: the microphone says what it needs (test_playground_mic.py talks)
        assert not browser.find_element(By.ID, "talk").is_enabled()
        talk_status = browser.find_element(By.ID, "talk-status").text
        assert talk_status.startswith("no pipeline served takes speech"), talk_status
        icon = browser.find_element(By.CSS_SELECTOR, "link[rel=icon]").get_attribute("href")
        assert (icon or "").startswith("data:image/svg+xml")
        keep(browser, tmp_path, "playground.png")

        # a phone's width: nothing wider than the screen; Ctrl+Enter sends
        browser.set_window_size(390, 844)
        wait.until(lambda d: d.execute_script("return window.innerWidth") <= 390)
        prompt.send_keys(Keys.CONTROL, Keys.ENTER)
        wait.until(lambda _d: body.get_attribute("data-state") == "streaming")
        wait.until(lambda _d: body.get_attribute("data-state") in {"done", "error"})
        assert body.get_attribute("data-state") == "done"
        overflow = browser.execute_script(
            "return document.documentElement.scrollWidth - window.innerWidth"
        )
        assert overflow <= 0, f"{overflow} px wider than a 390 px screen"
        keep(browser, tmp_path, "playground-390.png")
