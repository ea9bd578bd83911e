"""The chat page in a real browser: headless Chromium driven through selenium.

Against a real server with no --model (the embedded stories260K): load the
page, chat (typed prompt, Enter to send, streamed answer, statistics under
it), take a screenshot, then start a long completion, watch its text grow,
press Stop, and check that the engine itself dropped the request.

Needs Debian's ``chromium`` and ``chromium-driver``; ``make test-browser``
installs them and runs this file. The screenshot goes to the test's temporary
directory, and also to $RINGLLM_SCREENSHOT when that is set (docs/chat-page.png
was made so).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# The network is closed: without these Chromium keeps trying to reach Google.
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=820,900",
)
LONG_MAX_TOKENS = 60000  # far more than can be generated before Stop is pressed


def _why_not_runnable() -> str | None:
    if CHROMIUM is None or CHROMEDRIVER is None:
        return ("Chromium and chromedriver are not installed (Debian packages chromium and "
                "chromium-driver): run `make test-browser`, which installs them and runs this test")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is missing: install the dev extras (`make install`)"
    return None


if (reason := _why_not_runnable()) is not None:
    pytest.skip(reason, allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402

from tests.support.waiting import wait_for  # noqa: E402


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    options = Options()
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def set_field(driver: WebDriver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def last(driver: WebDriver, selector: str):
    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return found[-1] if found else None


def answer_state(driver: WebDriver, selector: str) -> str | None:
    article = last(driver, selector)
    return article.get_attribute("data-state") if article is not None else None


def test_chat_page_streams_and_stop_aborts_in_the_engine(server_factory, browser: WebDriver, tmp_path: Path) -> None:
    server = server_factory(["--max-model-len", "65536", "--seed", "0"])
    browser.get(server.base_url + "/")
    wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true",
             "the page to load its model list")
    assert browser.title == "ringllm"
    assert browser.find_element(By.ID, "model").get_attribute("value") == "stories260K"
    # Every control has a label (screen readers, and clicking the label focuses it).
    for control in browser.find_elements(By.CSS_SELECTOR, "input, select, textarea"):
        control_id = control.get_attribute("id")
        assert browser.find_elements(By.CSS_SELECTOR, f'label[for="{control_id}"]'), control_id
    assert not browser.find_element(By.ID, "api-key-row").is_displayed()  # no --api-key

    # Chat: greedy, so the answers are the model's best; Enter sends, then the Send button.
    set_field(browser, "temperature", "0")
    for i, message in enumerate(["Hello!", "Do you want to play in the park?"]):
        prompt = browser.find_element(By.ID, "prompt")
        prompt.send_keys(message)
        if i == 0:
            prompt.send_keys(Keys.ENTER)
        else:
            browser.find_element(By.ID, "send").click()
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#log-chat .msg.assistant")) == i + 1,
                 "the answer to appear")
        wait_for(lambda: answer_state(browser, "#log-chat .msg.assistant") == "done", "the answer to finish", 60)
        answer = last(browser, "#log-chat .msg.assistant")
        text = answer.find_element(By.CSS_SELECTOR, ".text").text
        assert len(text.split()) >= 3 and "\ufffd" not in text, text
        stats = answer.find_element(By.CSS_SELECTOR, ".stats").text
        assert "tokens/s" in stats and "TTFT" in stats and "finish: stop" in stats, stats
    screenshot = tmp_path / "chat-page.png"
    assert browser.save_screenshot(str(screenshot))
    if target := os.environ.get("RINGLLM_SCREENSHOT"):
        shutil.copyfile(screenshot, target)

    # Completion: a generation far longer than the test waits for, stopped midway.
    browser.find_element(By.CSS_SELECTOR, 'label[for="mode-completion"]').click()
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "Once upon a time"
    set_field(browser, "max-tokens", str(LONG_MAX_TOKENS))
    browser.find_element(By.CSS_SELECTOR, 'label[for="ignore-eos"]').click()  # no story ending: run till Stop
    browser.find_element(By.ID, "send").click()
    selector = "#log-completion .msg.completion"

    def streamed_text() -> str:
        article = last(browser, selector)
        return article.find_element(By.CSS_SELECTOR, ".text").text if article is not None else ""

    first = wait_for(lambda: len(streamed_text()) > len("Once upon a time") + 10 and streamed_text(), "streamed text")
    wait_for(lambda: len(streamed_text()) > len(first), "more streamed text")
    assert answer_state(browser, selector) == "streaming"
    assert server.engine_stats()["num_running_reqs"] == 1
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: answer_state(browser, selector) == "stopped", "the page to show the stop")

    # The engine dropped the request: nothing runs or waits, and no step runs any more.
    stats = wait_for(
        lambda: (s := server.engine_stats())["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0 and s,
        "the engine to abort the request",
    )
    time.sleep(0.5)
    assert server.engine_stats()["step_counter"] == stats["step_counter"] < LONG_MAX_TOKENS
    line = last(browser, selector).find_element(By.CSS_SELECTOR, ".stats").text
    assert "stopped" in line, line
    generated = int(line.split(" tokens")[0].lstrip("≈"))
    assert 0 < generated < LONG_MAX_TOKENS, line


def test_chat_page_asks_for_the_api_key(server_factory, browser: WebDriver) -> None:
    server = server_factory(["--api-key", "sekret"])
    browser.get(server.base_url + "/")
    key_row = browser.find_element(By.ID, "api-key-row")
    wait_for(key_row.is_displayed, "the API key field")
    wait_for(lambda: "API key" in browser.find_element(By.ID, "status").text, "the page to ask for the key")
    key = browser.find_element(By.ID, "api-key")
    key.send_keys("wrong", Keys.TAB)
    wait_for(lambda: "refused" in browser.find_element(By.ID, "status").text, "the wrong key to be refused")
    key.clear()
    key.send_keys("sekret", Keys.TAB)
    wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true",
             "the model list, with the key")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("Hello!", Keys.ENTER)
    wait_for(lambda: answer_state(browser, "#log-chat .msg.assistant") == "done", "an answer", 60)
    assert last(browser, "#log-chat .msg.assistant").find_element(By.CSS_SELECTOR, ".text").text
