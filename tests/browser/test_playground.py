"""The playground page in headless Chromium against a real edge and a real worker serving the
default model: streaming, stop, tool calls, error events, logprobs, figures, API keys, no network."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tests.browser.conftest import WINDOW, requested_urls
from tests.browser.page import Playground
from tests.images import b64, tiny_png
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

LONG_RUN = json.dumps({"ignore_eos": True})
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# Set to a folder (docs) to refresh the README's screenshot from a test run.
SCREENSHOT_COPY_ENV = "SLUICE_PLAYGROUND_SCREENSHOT_DIR"


@pytest.fixture(scope="module")
def worker_id(default_edge: EdgeProcess) -> str:
    """The serving worker's id, as the edge reports it."""
    return httpx.get(f"{default_edge.base_url}/v1/models").headers["X-Sluice-Worker-ID"]


@pytest.fixture
def page(browser: Any, default_edge: EdgeProcess) -> Iterator[Playground]:
    browser.set_window_size(*WINDOW)
    requested_urls(browser)  # forget earlier tests' requests
    playground = Playground(browser, default_edge.base_url)
    playground.wait_for_models()
    yield playground
    # Every request any test made stayed on the edge's own origin (a data: URL, an attached image's
    # thumbnail, is read from the page itself).
    outside = [
        url
        for url in requested_urls(browser)
        if not url.startswith((default_edge.base_url + "/", "data:image/"))
    ]
    assert not outside, f"requests left the edge's origin: {outside}"


def settled(worker: WorkerProcess, within_s: float = 15.0) -> dict[str, float]:
    """The worker's metrics once it runs, queues and caches nothing."""
    end = time.monotonic() + within_s
    while True:
        values = worker.metrics()
        busy = {
            name: values[f"sluice_worker_{name}"]
            for name in ("running_requests", "running_sequences", "queue_depth", "live_caches")
            if values[f"sluice_worker_{name}"]
        }
        if not busy:
            return values
        assert time.monotonic() < end, f"the worker is still busy: {busy}"
        time.sleep(0.05)


def test_page_loads_offline_with_only_its_own_files(browser: Any, default_edge: EdgeProcess) -> None:
    requested_urls(browser)
    page = Playground(browser, default_edge.base_url, "/")
    assert page.wait_for_models() == ["SmolLM2-135M-Instruct"]
    urls = requested_urls(browser)
    base = default_edge.base_url
    assert {
        f"{base}/",
        f"{base}/static/playground.js",
        f"{base}/static/playground.css",
        f"{base}/v1/models",
    } <= set(urls)
    assert all(url.startswith(base + "/") for url in urls), urls
    # Nothing else is reachable from the page: a fetch to another host fails (refused by the page's
    # Content-Security-Policy before the cut-off network would fail it).
    failed = browser.execute_async_script(
        "const done = arguments[0]; fetch('http://example.com/').then(() => done(false), () => done(true));"
    )
    assert failed
    severe = [
        e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "example.com" not in e["message"]
    ]
    assert not severe, severe


def test_streamed_answer_grows_and_stop_frees_the_sequence(
    page: Playground, default_worker: WorkerProcess, screenshot_dir: Path
) -> None:
    page.fill("system", "You are a storyteller.")
    page.fill("temperature", "0.7")
    page.fill("seed", "7")
    page.click("logprobs")
    page.fill("max_tokens", "6")
    page.send("Greet the lighthouse.")  # a first, short turn: its figures show in the screenshot
    page.wait_until_finished()
    before = settled(default_worker)
    page.fill("max_tokens", "2000")
    page.paste("extra", LONG_RUN)
    page.send("Now tell me a long story about its keeper.")
    lengths = page.watch_growth(samples=5)
    assert len(lengths) > 5 and lengths == sorted(lengths), (
        f"the answer did not grow token by token: {lengths}"
    )
    assert page.last_answer().find_element(By.CSS_SELECTOR, ".answer").get_attribute("aria-busy") == "true"
    assert default_worker.metrics()["sluice_worker_running_sequences"] == 1
    first_answer_token = page.driver.find_elements(By.CSS_SELECTOR, "#log > li.assistant .tok")[1]
    ActionChains(page.driver).move_to_element(first_answer_token).perform()  # alternatives, in the picture
    shot = screenshot_dir / "playground.png"
    page.driver.save_screenshot(str(shot))
    print(f"mid-stream screenshot: {shot}")
    if copy_to := os.environ.get(SCREENSHOT_COPY_ENV):
        shutil.copy(shot, Path(copy_to) / "playground.png")

    page.by_id("stop").click()
    stats = page.wait_until_finished()
    assert stats["end"] == "stopped by you"
    after = settled(default_worker)  # the sequence and its cache are gone
    assert (
        after["sluice_worker_requests_cancelled_total"]
        == before["sluice_worker_requests_cancelled_total"] + 1
    )
    assert after["sluice_worker_reserved_tokens"] == 0
    stopped_at = page.answer_text()
    assert stopped_at and int(stats["completion"]) >= 5
    assert page.by_id("send").is_enabled() and not page.by_id("stop").is_enabled()
    assert page.last_answer().find_element(By.CSS_SELECTOR, ".answer").get_attribute("aria-busy") == "false"


def test_forced_tool_call_renders_valid_json_arguments(page: Playground) -> None:
    page.paste("tools", json.dumps([WEATHER_TOOL]))  # small: a short prompt and a short call
    page.choose("tool_choice", "function:get_weather")
    page.fill("temperature", "0")
    page.fill("max_tokens", "60")
    page.send("What is the weather in Paris, in celsius?")
    stats = page.wait_until_finished()
    assert stats["end"] == "tool_calls", stats
    call = page.last_answer().find_element(By.CSS_SELECTOR, ".tool")
    assert call.find_element(By.CSS_SELECTOR, ".name").text == "get_weather"
    arguments = json.loads(call.find_element(By.CSS_SELECTOR, "pre.args").text)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    assert call.find_element(By.CSS_SELECTOR, ".badge").text == "valid JSON"
    # The next message can answer the call as its tool result.
    assert page.by_id("reply-as-tool").is_displayed() and page.by_id("as-tool").is_selected()


def test_error_event_mid_stream_is_displayed(page: Playground, default_worker: WorkerProcess) -> None:
    page.fill("max_tokens", "2000")
    page.paste("extra", LONG_RUN)
    page.fill("timeout", "3")  # X-Sluice-Timeout: the edge ends the stream with an error event
    page.send("Write a very long essay about rivers.")
    stats = page.wait_until_finished()
    # The stream had started (a 200 with its role chunk; the worker answers "started" on admission)
    # when the edge ended it with `event: error`: shown as such, whatever tokens came before it.
    assert stats["end"] == "error event", stats
    error = page.error_text()
    assert "Error event from the server" in error and "timeout_error" in error, error
    assert page.driver.find_element(By.ID, "status").text == "The stream ended with an error."
    settled(default_worker)


def test_logprobs_on_hover_and_the_final_figures(page: Playground, worker_id: str) -> None:
    page.click("logprobs")
    page.fill("top_logprobs", "3")
    page.fill("temperature", "0")
    page.fill("max_tokens", "5")
    page.send("Name three colours.")
    stats = page.wait_until_finished()
    assert stats["end"] in ("stop", "length")
    assert int(stats["prompt"]) > 0 and 1 <= int(stats["completion"]) <= 5
    assert int(stats["cached"]) >= 0 and stats["ttft"].endswith(" ms")
    assert stats["worker"] == worker_id and stats["request"].startswith("req_")
    if int(stats["completion"]) > 1:
        assert float(stats["rate"]) > 0

    tokens = page.last_answer().find_elements(By.CSS_SELECTOR, ".answer .tok")
    assert tokens and "".join(t.text for t in tokens).strip() == page.answer_text().strip()
    ActionChains(page.driver).move_to_element(tokens[0]).perform()
    tip = page.by_id("tip")
    page.wait(tip.is_displayed, 5, "no tooltip on hover")
    assert len(tip.find_elements(By.CSS_SELECTOR, "tr.chosen")) == 1
    assert len(tip.find_elements(By.CSS_SELECTOR, "tr.alt")) == 3
    # The keyboard reaches the same figures: focus the answer, then arrow keys.
    answer = page.last_answer().find_element(By.CSS_SELECTOR, ".answer")
    ActionChains(page.driver).move_by_offset(0, 300).perform()
    answer.send_keys(Keys.END)
    assert tokens[-1].get_attribute("class") == "tok active"
    assert page.by_id("tip").is_displayed()
    assert f"Token {len(tokens)} of {len(tokens)}" in page.by_id("status").text


def test_json_schema_output_is_checked(page: Playground) -> None:
    page.click("schema-example")
    page.fill("temperature", "0")
    page.fill("max_tokens", "40")
    page.send("Invent a person.")
    stats = page.wait_until_finished()
    assert stats["end"] == "stop", stats
    assert json.loads(page.answer_text()).keys() == {"name", "age"}
    assert page.last_answer().find_element(By.CSS_SELECTOR, ".json-verdict").text == "valid JSON"


def test_conversation_is_kept_and_a_narrow_screen_does_not_scroll_sideways(page: Playground) -> None:
    page.driver.set_window_size(390, 844)
    page.fill("max_tokens", "3")
    page.fill("temperature", "0")
    page.send("Hello!")
    page.wait_until_finished()
    page.send("And again?")
    page.wait_until_finished()
    turns = page.driver.find_elements(By.CSS_SELECTOR, "#log > li")
    assert [t.get_attribute("class") for t in turns] == ["user", "assistant", "user", "assistant"]
    width = page.driver.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth];"
    )
    assert width[0] <= width[1], f"the page scrolls sideways at 390 px: {width}"
    # Every form field has a label a screen reader can read.
    unlabelled = page.driver.execute_script(
        "return [...document.querySelectorAll('input, select, textarea')]"
        ".filter((f) => !f.labels || !f.labels.length).map((f) => f.id);"
    )
    assert unlabelled == []


# Hands the page files as a paste into the composer and as a drop onto the message form would.
GIVE_FILES = """
const [how, files] = arguments;
const data = new DataTransfer();
for (const [name, type, b64] of files) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  data.items.add(new File([bytes], name, { type }));
}
const target = document.getElementById(how === 'paste' ? 'composer' : 'send-form');
const event = how === 'paste'
  ? new ClipboardEvent('paste', { clipboardData: data, bubbles: true, cancelable: true })
  : new DragEvent('drop', { dataTransfer: data, bubbles: true, cancelable: true });
target.dispatchEvent(event);
"""
RECORD_BODIES = """
window.sentBodies = [];
const original = window.fetch;
window.fetch = (url, options) => {
  window.sentBodies.push(options && options.body);
  return original(url, options);
};
"""


def test_a_pasted_and_a_dropped_image_are_sent_as_image_url_parts(page: Playground) -> None:
    red, green = tiny_png(rgb=(220, 0, 0)), tiny_png(rgb=(0, 200, 0))
    page.driver.execute_script(RECORD_BODIES)
    page.driver.execute_script(GIVE_FILES, "paste", [["red.png", "image/png", b64(red)]])
    page.driver.execute_script(GIVE_FILES, "drop", [["green.png", "image/png", b64(green)]])
    page.driver.execute_script(GIVE_FILES, "drop", [["notes.txt", "text/plain", b64(b"hello")]])
    page.wait(lambda: len(page.driver.find_elements(By.CSS_SELECTOR, "#images img")) == 2, 10, "not attached")
    assert "Not attached: text/plain" in page.by_id("status").text
    page.send("What is in these pictures?")
    # The default model takes no images: the edge refuses the request naming the first image part.
    page.wait(lambda: page.last_stat("end") == "refused", message="the request was not refused")
    assert "image_not_supported" in page.error_text() and "messages[0].content[1]" in page.error_text()
    (body,) = [json.loads(b) for b in page.driver.execute_script("return window.sentBodies;")]
    last = body["messages"][-1]
    assert last["role"] == "user"
    assert [part["type"] for part in last["content"]] == ["text", "image_url", "image_url"]
    assert last["content"][0]["text"] == "What is in these pictures?"
    urls = [part["image_url"]["url"] for part in last["content"][1:]]
    assert urls == [f"data:image/png;base64,{b64(red)}", f"data:image/png;base64,{b64(green)}"]
    # The turn shows its images; refused, it gives its text and images back for another try.
    shown = page.driver.find_elements(By.CSS_SELECTOR, "#log > li.user img")
    assert [img.get_attribute("src") for img in shown] == urls
    assert len(page.driver.find_elements(By.CSS_SELECTOR, "#images img")) == 2
    assert page.by_id("composer").get_attribute("value") == "What is in these pictures?"
    page.click("clear")
    assert page.driver.find_elements(By.CSS_SELECTOR, "#images img") == []


@pytest.fixture(scope="module")
def keyed_edge(
    default_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EdgeProcess]:
    """An edge that requires the API key ``sk-playground``."""
    extra = ["--api-keys", "sk-playground"]
    with EdgeProcess(
        [default_worker.address], log_dir=tmp_path_factory.mktemp("keyed-edge"), extra=extra
    ) as edge:
        yield edge


def test_api_key_is_asked_for_and_kept_only_in_memory(browser: Any, keyed_edge: EdgeProcess) -> None:
    for path in ("/", "/playground", "/static/playground.js"):
        response = httpx.get(keyed_edge.base_url + path)
        assert response.status_code == 200, path  # the page itself needs no key
    assert "default-src 'none'" in httpx.get(keyed_edge.base_url + "/").headers["Content-Security-Policy"]

    page = Playground(browser, keyed_edge.base_url)
    page.wait(lambda: page.by_id("key-form").is_displayed(), 30, "the page did not ask for a key")
    assert page.driver.switch_to.active_element == page.by_id("api-key")
    page.by_id("api-key").send_keys("sk-wrong", Keys.ENTER)
    page.wait(lambda: "refused this key" in page.by_id("key-reason").text, 30)
    page.by_id("api-key").send_keys("sk-playground", Keys.ENTER)
    assert page.wait_for_models() == ["SmolLM2-135M-Instruct"]
    page.fill("max_tokens", "2")
    page.send("Hi")
    assert page.wait_until_finished()["end"] in ("stop", "length")
    stored = page.driver.execute_script(
        "return [localStorage.length, sessionStorage.length, document.cookie, document.body.innerHTML];"
    )
    assert stored[:3] == [0, 0, ""]
    assert "sk-playground" not in stored[3]
    # Reloading forgets the key.
    page = Playground(browser, keyed_edge.base_url)
    page.wait(lambda: page.by_id("key-form").is_displayed(), 30, "a reload kept the key")
