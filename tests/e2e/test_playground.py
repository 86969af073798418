"""The playground page in headless Chromium against `omni-runtime serve` (embedded deployment).

Needs Chromium and its driver (Debian: `apt-get install chromium chromium-driver`);
without them the test is skipped, except under CI=true where it fails.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from tests.e2e.serving import ROOT, ServeProcess
from tests.services import unavailable

pytestmark = pytest.mark.timeout(180)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACT_DIR = ROOT / "test-artifacts"
PROMPT = "Hello from the playground, streaming text and audio!"


def _unavailable(reason: str) -> NoReturn:
    unavailable(reason, "Chromium")


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        _unavailable(
            f"{', '.join(missing)} not installed (apt-get install chromium chromium-driver)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install -e '.[test]')")
    monkeypatch.setenv("SE_OFFLINE", "true")  # never let Selenium Manager download anything
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--autoplay-policy=no-user-gesture-required",
        "--window-size=1000,900",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


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
        assert headings == ["TIMING", "ANSWER", "AUDIO"]  # shown upper-case
        assert "Ctrl+Enter sends" in browser.find_element(By.ID, "hint").text
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


def keep(browser: object, tmp_path: Path, name: str) -> None:
    """A screenshot, kept under test-artifacts/."""
    shot = tmp_path / name
    assert browser.save_screenshot(str(shot))  # type: ignore[attr-defined]
    ARTIFACT_DIR.mkdir(exist_ok=True)
    shutil.copyfile(shot, ARTIFACT_DIR / name)
    assert shot.stat().st_size > 10_000
