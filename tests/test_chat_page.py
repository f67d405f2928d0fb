"""The chat page at `GET /`: its headers and static files, the timings it reads from the stream, and the page
itself driven in headless Chromium (Debian's `chromium` + `chromium-driver`, through Selenium) against a
loopback server with a scripted engine that reports speculative rounds.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from dflash.generation.request import GenerationRequest, GenerationResult
from dflash.server.app import create_app
from dflash.server.settings import ServerSettings
from tests.server_helpers import FakeEngine, sdk_clients, serving, wait_until

ACCEPTED_PER_ROUND = (3, 0, 5, 3, 1, 3)  # -> histogram [1, 1, 0, 3, 0, 1], 15 accepted in 6 rounds
HISTOGRAM = [1, 1, 0, 3, 0, 1]
TOKENS_PER_S = 42.5


@dataclass
class SpeculatingEngine(FakeEngine):
    """`FakeEngine` whose results report speculative rounds and a fixed decode speed."""

    def __post_init__(self) -> None:
        self.options = SimpleNamespace(spec="ddtree")

    def generate(self, request: GenerationRequest, **kwargs: Any) -> GenerationResult:
        result = super().generate(request, **kwargs)
        for accepted in ACCEPTED_PER_ROUND:
            result.stats.record_round(drafted=8, accepted=accepted)
        result.stats.decode_s = result.stats.completion_tokens / TOKENS_PER_S
        return result


# ------------------------------------------------------------------------------------ without a browser
def test_page_and_static_files_are_served_with_a_strict_policy() -> None:
    with serving(create_app(FakeEngine())) as server:
        page = httpx.get(f"{server.url}/", timeout=10)
        script = httpx.get(f"{server.url}/static/chat.js", timeout=10)
        style = httpx.get(f"{server.url}/static/chat.css", timeout=10)
        missing = httpx.get(f"{server.url}/static/app.py", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert "unsafe-inline" not in policy and "frame-ancestors 'none'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    assert '<script src="/static/chat.js"' in page.text and '<link rel="stylesheet" href="/static/chat.css">' in page.text
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")
    for body in (page.text, script.text, style.text):  # nothing is loaded from another origin
        assert re.search(r"https?://|@import|@font-face", body) is None
    assert "innerHTML" not in script.text  # model output is only set as text
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_stream_and_plain_responses_carry_the_acceptance_histogram() -> None:
    with serving(create_app(SpeculatingEngine(default="Four tokens."))) as server:
        oa, _ = sdk_clients(server)
        chunks = list(oa.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True,
        ))
        plain = oa.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    last = chunks[-1]
    assert last.choices[0].finish_reason == "stop"
    for timings in (last.model_extra["timings"], plain.model_extra["timings"]):
        assert timings["acceptance_histogram"] == HISTOGRAM
        assert timings["rounds"] == 6 and timings["accepted_tokens"] == 15
        assert timings["acceptance_length"] == 3.5
        assert timings["predicted_per_second"] == TOKENS_PER_S and timings["spec"] == "ddtree"
    assert all("timings" not in (c.model_extra or {}) for c in chunks[:-1])  # only the final chunk


# --------------------------------------------------------------------------------------- in Chromium
def _browser_paths() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    paths = _browser_paths()
    if paths is None:
        pytest.skip("headless Chromium not found: install Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1100,760", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=paths[1]))
    try:
        yield driver
    finally:
        driver.quit()


def _text(driver: Any, selector: str) -> str:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return str(found[-1].text) if found else ""


def _wait(driver: Any, condition: Callable[[], bool], what: str) -> None:
    assert wait_until(condition, timeout=15), f"timed out waiting for {what}; page shows: {_text(driver, 'body')!r}"


@pytest.mark.slow
def test_chat_page_streams_answers_with_speed_and_acceptance(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    first = ("A tree of drafted continuations: the target checks every branch in one forward pass and keeps "
             "the longest accepted path. Markup such as <b>this</b> & that is shown as text.")
    engine = SpeculatingEngine(default="Fresh answer.").script(first, "Against the drafter's proposals, round by round.")
    with serving(create_app(engine, ServerSettings(api_key="sekret"))) as server:
        browser.get(f"{server.url}/")
        # Without a key the models call is refused: the page says so and stores nothing.
        _wait(browser, lambda: "API key" in _text(browser, "#notice"), "the API-key notice")
        assert _text(browser, "#model") == "model unavailable"
        assert browser.execute_script("return localStorage.getItem('dflash.apiKey')") is None

        key = browser.find_element(By.ID, "api-key")
        key.send_keys("sekret", Keys.TAB)
        _wait(browser, lambda: _text(browser, "#model") == "fake-model · spec ddtree", "the model id")
        assert browser.execute_script("return localStorage.getItem('dflash.apiKey')") == "sekret"
        assert not browser.find_element(By.ID, "notice").is_displayed()

        prompt = browser.find_element(By.ID, "prompt")
        prompt.send_keys("What does DDTree verify?", Keys.ENTER)
        _wait(browser, lambda: _text(browser, ".assistant .status") == "finished: stop", "the first answer")
        assert _text(browser, ".user .text") == "What does DDTree verify?"
        assert _text(browser, ".assistant .text") == first  # markup in the answer is shown as text
        assert browser.find_elements(By.CSS_SELECTOR, "#conversation .text b") == []
        assert _text(browser, ".assistant .tokens-per-second .value") == "42.5"
        assert _text(browser, ".assistant .acceptance-length .value") == "3.50"
        assert _text(browser, ".assistant .rounds .value") == "6"
        assert _text(browser, ".assistant .accepted .value") == "15"
        assert _text(browser, ".assistant .spec .value") == "ddtree"
        bins = browser.find_elements(By.CSS_SELECTOR, ".assistant .histogram .bin")
        assert [b.get_attribute("data-k") for b in bins] == [str(k) for k in range(len(HISTOGRAM))]
        assert [b.get_attribute("data-count") for b in bins] == [str(c) for c in HISTOGRAM]
        heights = [b.find_element(By.CLASS_NAME, "bar").size["height"] for b in bins]
        assert heights[3] == max(heights) and heights[3] > heights[0] > heights[2]

        # The second turn sends the whole conversation.
        prompt.send_keys("Against what?", Keys.ENTER)
        _wait(browser, lambda: _text(browser, ".assistant .text") == "Against the drafter's proposals, round by round.", "the second answer")
        _wait(browser, lambda: len(browser.find_elements(By.CSS_SELECTOR, ".assistant .stats")) == 2, "second stats")
        assert "DDTree verify?" in engine.prompts[-1] and first in engine.prompts[-1] and "Against what?" in engine.prompts[-1]
        browser.save_screenshot(str(tmp_path / "chat_page.png"))
        assert (tmp_path / "chat_page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        # Stop aborts the fetch, and the server stops generating.
        engine.token_delay = 0.05
        engine.script("word " * 400)
        prompt.send_keys("Write a lot", Keys.ENTER)
        _wait(browser, lambda: _text(browser, ".assistant .text").startswith("word word"), "streamed words")
        browser.find_element(By.ID, "stop").click()
        _wait(browser, lambda: _text(browser, ".assistant .status") == "stopped", "the stopped status")
        assert wait_until(lambda: len(engine.stopped_early) == 3 and engine.stopped_early[-1], timeout=10)
        assert browser.find_element(By.ID, "send").is_enabled()
        assert not browser.find_element(By.ID, "stop").is_enabled()

        # Clear empties the view and the history the next request sends.
        engine.token_delay = 0.0
        browser.find_element(By.ID, "clear").click()
        assert browser.find_elements(By.CSS_SELECTOR, "#conversation .message") == []
        prompt.send_keys("Fresh start", Keys.ENTER)
        _wait(browser, lambda: _text(browser, ".assistant .status") == "finished: stop", "the answer after clearing")
        assert _text(browser, ".assistant .text") == "Fresh answer."
        assert "Fresh start" in engine.prompts[-1] and "DDTree" not in engine.prompts[-1]
        assert len(browser.find_elements(By.CSS_SELECTOR, "#conversation .message")) == 2
