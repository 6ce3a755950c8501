"""How the playground renders every kind of stream event, with a scripted server.

The edge serves the real page (no worker behind it); the page's ``fetch`` is
replaced before its script runs by one that answers ``/v1/models`` and
``/v1/chat/completions`` from a script, cut into pieces of random sizes so the
page's SSE parser sees events split anywhere. This covers what the default
model cannot produce on demand: reasoning, heartbeats, an error event after
content, a stream cut before ``[DONE]``, CRLF line ends. The real streams are
in test_playground.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from selenium.webdriver.common.by import By

from tests.browser.page import Playground
from tests.processes import LiveEdgeProcess, free_port

pytestmark = pytest.mark.browser

MODEL = "scripted-model"
# Installed before the page's own script: answers from window.__script (set per test) in pieces.
FAKE_FETCH = """
window.__requests = [];
window.fetch = async (url, init) => {
  const script = window.__script || {};
  window.__requests.push({url: String(url), init: init || {}});
  const headers = {"X-Sluice-Worker-ID": "scripted-worker", "X-Request-ID": "req_scripted"};
  if (String(url).endsWith("v1/models")) {
    return new Response(JSON.stringify({object: "list", data: [{id: "MODEL_ID", object: "model"}]}),
      {status: 200, headers: {...headers, "Content-Type": "application/json"}});
  }
  const pieces = script.pieces || [];
  const body = new ReadableStream({
    async pull(controller) {
      // Like a real fetch: aborting fails the pending read with an AbortError.
      if (init && init.signal && init.signal.aborted) {
        controller.error(new DOMException("The user aborted a request.", "AbortError"));
        return;
      }
      if (!pieces.length) { controller.close(); return; }
      await new Promise((resolve) => setTimeout(resolve, 2));
      controller.enqueue(new TextEncoder().encode(pieces.shift()));
    },
  });
  return new Response(body, {status: 200, headers: {...headers, "Content-Type": "text/event-stream"}});
};
""".replace("MODEL_ID", MODEL)


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [
            {"index": 0, "delta": delta, "logprobs": extra.pop("logprobs", None), "finish_reason": finish}
        ],
        **extra,
    }


def sse(events: list[Any], newline: str = "\n") -> str:
    """The wire text: dicts as ``data:`` events, ``("error", payload)`` as an error event, strings as-is."""
    out = []
    for event in events:
        if isinstance(event, dict):
            out.append(f"data: {json.dumps(event)}{newline}{newline}")
        elif isinstance(event, tuple):
            out.append(f"event: {event[0]}{newline}data: {json.dumps(event[1])}{newline}{newline}")
        else:
            out.append(event.replace("\n", newline))
    return "".join(out)


def pieces(text: str, seed: int) -> list[str]:
    """``text`` cut at random places into pieces of 1 to 9 characters."""
    rng = random.Random(seed)
    cuts, at = [], 0
    while at < len(text):
        step = rng.randint(1, 9)
        cuts.append(text[at : at + step])
        at += step
    return cuts


USAGE = {
    "prompt_tokens": 11,
    "completion_tokens": 4,
    "total_tokens": 15,
    "prompt_tokens_details": {"cached_tokens": 8},
    "completion_tokens_details": {"reasoning_tokens": 2},
}
REASONING_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    ": heartbeat\n\n",
    chunk({"reasoning_content": "Let me "}),
    chunk({"reasoning_content": "think."}),
    chunk({"content": "Hi"}, logprobs={"content": [{"token": "Hi", "logprob": -0.1, "top_logprobs": []}]}),
    chunk({"content": " there"}),
    chunk({}, "stop"),
    {**chunk({}), "choices": [], "usage": USAGE},
    "data: [DONE]\n\n",
]


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveEdgeProcess]:
    """An edge with no reachable worker: it serves the page; the scripted fetch answers the API."""
    with LiveEdgeProcess(
        [f"127.0.0.1:{free_port()}"], log_dir=tmp_path_factory.mktemp("page-edge")
    ) as process:
        yield process


@pytest.fixture
def page(browser: Any, edge: LiveEdgeProcess) -> Iterator[Playground]:
    script = browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": FAKE_FETCH})
    try:
        playground = Playground(browser, edge.base_url, "/")
        assert playground.wait_for_models() == [MODEL]
        yield playground
    finally:
        browser.execute_cdp_cmd(
            "Page.removeScriptToEvaluateOnNewDocument", {"identifier": script["identifier"]}
        )


def run_script(page: Playground, text: str, seed: int) -> dict[str, str]:
    page.driver.execute_script("window.__script = {pieces: arguments[0]};", pieces(text, seed))
    page.send("Hello")
    return page.wait_until_finished()


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_reasoning_heartbeat_content_and_figures(page: Playground, newline: str) -> None:
    stats = run_script(page, sse(REASONING_STREAM, newline), seed=len(newline))
    answer = page.last_answer()
    reasoning = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.is_displayed() and reasoning.get_attribute("open") is not None
    assert reasoning.find_element(By.TAG_NAME, "div").text == "Let me think."
    reasoning.find_element(By.TAG_NAME, "summary").click()  # collapsible
    assert reasoning.get_attribute("open") is None
    assert answer.find_element(By.CSS_SELECTOR, ".answer").text == "Hi there"
    assert "1 heartbeat" in answer.find_element(By.CSS_SELECTOR, ".events").text
    assert not page.error_text()
    assert stats == {
        "end": "stop",
        "ttft": stats["ttft"],
        "prompt": "11",
        "completion": "4",
        "cached": "8",
        "reasoning": "2",
        "worker": "scripted-worker",
        "request": "req_scripted",
        **({"rate": stats["rate"]} if "rate" in stats else {}),
    }
    assert stats["ttft"].endswith(" ms")
    # What the page asked for: the settings, and usage on every chunk.
    body = json.loads(page.driver.execute_script("return window.__requests.at(-1).init.body;"))
    assert body["model"] == MODEL and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["messages"] == [{"role": "user", "content": "Hello"}]


def test_error_event_after_content_is_shown_and_the_turn_kept(page: Playground) -> None:
    error = {"error": {"message": "The model worker failed.", "type": "server_error", "code": "worker_lost"}}
    stats = run_script(
        page,
        sse(
            [
                chunk({"role": "assistant", "content": ""}),
                chunk({"content": "Part"}),
                ("error", error),
                "data: [DONE]\n\n",
            ]
        ),
        seed=3,
    )
    assert stats["end"] == "error event"
    assert "server_error, worker_lost: The model worker failed." in page.error_text()
    assert page.answer_text() == "Part"
    # The partial answer stays in the conversation sent with the next turn.
    page.driver.execute_script(
        "window.__script = {pieces: arguments[0]};",
        [sse([chunk({"content": "ok"}), chunk({}, "stop"), "data: [DONE]\n\n"])],
    )
    page.send("Go on")
    page.wait_until_finished()
    body = json.loads(page.driver.execute_script("return window.__requests.at(-1).init.body;"))
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][1]["content"] == "Part"


def test_a_stream_cut_before_done_is_reported(page: Playground) -> None:
    stats = run_script(
        page, sse([chunk({"role": "assistant", "content": ""}), chunk({"content": "Half"})]), seed=4
    )
    assert stats["end"] == "incomplete"
    assert "without data: [DONE]" in page.error_text()


def test_tool_call_arguments_fill_in_and_settings_errors_name_the_field(page: Playground) -> None:
    deltas = [
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": '{"city": "Pa'}},
        {"index": 0, "function": {"arguments": 'ris"}'}},
    ]
    events = [chunk({"role": "assistant", "content": ""}), *(chunk({"tool_calls": [d]}) for d in deltas)]
    stats = run_script(page, sse([*events, chunk({}, "tool_calls"), "data: [DONE]\n\n"]), seed=5)
    assert stats["end"] == "tool_calls"
    call = page.last_answer().find_element(By.CSS_SELECTOR, ".tool")
    assert call.find_element(By.CSS_SELECTOR, ".name").text == "get_weather"
    assert json.loads(call.find_element(By.CSS_SELECTOR, "pre.args").text) == {"city": "Paris"}
    assert page.by_id("tool-call-id").text == "call_1"

    page.click("tools-example")  # the example's function becomes a forced choice
    assert "function:get_weather" in [
        o.get_attribute("value") for o in page.by_id("tool_choice").find_elements(By.TAG_NAME, "option")
    ]
    page.fill("top_p", "5")
    page.by_id("composer").send_keys("x")
    page.by_id("send").click()
    assert page.by_id("settings-error").text.startswith("top_p:")
    assert page.driver.switch_to.active_element == page.by_id("top_p")
    page.fill("top_p", "")
    page.paste("tools", "[not json")
    page.by_id("send").click()
    error = page.by_id("settings-error")
    assert error.is_displayed() and error.text.startswith("Tools is not valid JSON")
    assert page.driver.switch_to.active_element == page.by_id("tools")
    assert page.by_id("tools").get_attribute("aria-invalid") == "true"


def test_clearing_mid_stream_stops_and_forgets_the_turn(page: Playground) -> None:
    slow = [sse([chunk({"role": "assistant", "content": ""})]), *[sse([chunk({"content": "x"})])] * 3000]
    page.driver.execute_script("window.__script = {pieces: arguments[0]};", slow)
    page.send("First")
    page.wait(lambda: len(page.answer_text()) > 3, 30, "the scripted stream did not start")
    page.by_id("clear").click()
    page.wait(lambda: page.by_id("send").is_enabled(), 30, "the stream was not stopped")
    assert page.driver.find_elements(By.CSS_SELECTOR, "#log > li") == []
    page.driver.execute_script(
        "window.__script = {pieces: arguments[0]};",
        [sse([chunk({"content": "ok"}), chunk({}, "stop"), "data: [DONE]\n\n"])],
    )
    page.send("Second")
    page.wait_until_finished()
    body = json.loads(page.driver.execute_script("return window.__requests.at(-1).init.body;"))
    assert body["messages"] == [{"role": "user", "content": "Second"}]
