"""Image URLs through a real edge (``--allow-image-urls``) in front of the session's default worker:
a URL on a loopback address is refused with a 400 naming the part on every surface, and nothing
connects to the server behind it; an image for a text-only model is refused before the worker."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.images import data_url, tiny_png
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self) -> None:  # http.server's method name
        _Recorder.seen.append(self.path)
        body = tiny_png()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[int]:
    """A server on 127.0.0.1 that would answer any image URL; records each request."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def edge(default_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProcess]:
    """An edge of its own (``--allow-image-urls``) in front of the shared default worker: no request
    here reaches a worker, so none is started for this module."""
    with EdgeProcess(
        [default_worker.address], log_dir=tmp_path_factory.mktemp("edge-log"), extra=["--allow-image-urls"]
    ) as edge:
        yield edge


def chat(url: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is it?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "127.1"])
def test_a_loopback_image_url_is_refused(edge: EdgeProcess, image_server: int, host: str) -> None:
    reply = httpx.post(
        f"{edge.base_url}/v1/chat/completions", json=chat(f"http://{host}:{image_server}/cat.png")
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages[0].content[1]"
    assert "not a public address" in error["message"]
    assert _Recorder.seen == []


def test_every_surface_refuses_a_loopback_url(edge: EdgeProcess, image_server: int) -> None:
    url = f"http://127.0.0.1:{image_server}/cat.png"
    anthropic = httpx.post(
        f"{edge.base_url}/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": url}}]}
            ],
        },
    )
    assert anthropic.status_code == 400
    assert (
        anthropic.json()["type"] == "error"
        and "messages[0].content[0]" in anthropic.json()["error"]["message"]
    )
    responses = httpx.post(
        f"{edge.base_url}/v1/responses",
        json={
            "model": MODEL,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}],
        },
    )
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "input[0].content[0]"
    native = httpx.post(
        f"{edge.base_url}/api/v1/chat",
        json={
            "model": MODEL,
            "input": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        },
    )
    assert native.status_code == 400 and native.json()["error"]["param"] == "input[0].content[0]"
    assert _Recorder.seen == []


def test_an_image_for_a_text_only_model_is_refused(edge: EdgeProcess) -> None:
    reply = httpx.post(f"{edge.base_url}/v1/chat/completions", json=chat(data_url(tiny_png())))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == ("messages[0].content[1]", "image_not_supported")
