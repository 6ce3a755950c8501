"""Cross-origin calls from a real browser: pages served by two other local HTTP servers (two other
origins) ``fetch`` an edge that lists only the first in ``--allowed-origins`` (and asks for an API
key, which a preflight never carries). The allowed page's calls succeed (a preflighted JSON POST,
a stream read to its end, an error it can read); the other page's calls are refused by the browser."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.browser

KEY = "sk-browser"
PAGE = b"<!doctype html><html><head><title>another origin</title></head><body>cors</body></html>"
# Runs in the page: one fetch, its outcome as a plain object (a refused fetch rejects with a TypeError).
FETCH = """
const [url, options, done] = arguments;
fetch(url, options).then(
  async (response) => done({
    fetched: true,
    status: response.status,
    body: await response.text(),
    requestId: response.headers.get("X-Request-ID"),
  }),
  (error) => done({fetched: false, error: String(error)}),
);
"""


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server's method name
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def origins() -> Iterator[tuple[str, str]]:
    """Two page servers on 127.0.0.1, two ports: two origins, neither the edge's."""
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Page) for _ in range(2)]
    threads = [threading.Thread(target=server.serve_forever, daemon=True) for server in servers]
    for thread in threads:
        thread.start()
    try:
        allowed, other = (f"http://127.0.0.1:{server.server_address[1]}" for server in servers)
        yield allowed, other
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture(scope="module")
def cors_edge(
    default_worker: WorkerProcess, origins: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EdgeProcess]:
    extra = ["--allowed-origins", origins[0], "--api-keys", KEY]
    with EdgeProcess(
        [default_worker.address], log_dir=tmp_path_factory.mktemp("cors-edge"), extra=extra
    ) as edge:
        yield edge


def fetch_from(browser: Any, page: str, url: str, **options: Any) -> dict[str, Any]:
    browser.get(page + "/")
    browser.set_script_timeout(120)
    result: dict[str, Any] = browser.execute_async_script(FETCH, url, options)
    return result


def json_post(body: dict[str, Any], key: str | None = KEY) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}  # not a "simple" request: the browser preflights it
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return {"method": "POST", "headers": headers, "body": json.dumps(body)}


def test_the_allowed_origin_calls_the_edge(
    browser: Any, origins: tuple[str, str], cors_edge: EdgeProcess
) -> None:
    allowed, _ = origins
    base = cors_edge.base_url
    models = fetch_from(browser, allowed, f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models["fetched"] and models["status"] == 200, models
    assert '"object":"list"' in models["body"] and models["requestId"]  # an exposed header
    tokenized = fetch_from(browser, allowed, f"{base}/tokenize", **json_post({"prompt": "Hello from a page"}))
    assert tokenized["fetched"] and tokenized["status"] == 200, tokenized
    assert '"count":' in tokenized["body"]
    chat = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "stream": True,
    }
    streamed = fetch_from(browser, allowed, f"{base}/v1/chat/completions", **json_post(chat))
    assert streamed["fetched"] and streamed["status"] == 200, streamed
    assert streamed["body"].rstrip().endswith("data: [DONE]")
    refused = fetch_from(browser, allowed, f"{base}/tokenize", **json_post({"prompt": "x"}, key=None))
    assert refused["fetched"] and refused["status"] == 401, refused  # the page reads the error


def test_another_origin_is_refused_by_the_browser(
    browser: Any, origins: tuple[str, str], cors_edge: EdgeProcess
) -> None:
    _, other = origins
    base = cors_edge.base_url
    for url, options in (
        (f"{base}/v1/models", {"headers": {"Authorization": f"Bearer {KEY}"}}),
        (f"{base}/tokenize", json_post({"prompt": "Hello from elsewhere"})),
    ):
        result = fetch_from(browser, other, url, **options)
        assert not result["fetched"] and "TypeError" in result["error"], result
