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
ARTIFACT = ROOT / "test-artifacts" / "playground.png"
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

        shot = tmp_path / "playground.png"
        assert browser.save_screenshot(str(shot))
        ARTIFACT.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, ARTIFACT)
        assert shot.stat().st_size > 10_000
