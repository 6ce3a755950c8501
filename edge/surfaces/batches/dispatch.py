"""A batch line sent through the edge's own ASGI app, as a client's request would be: the same
hooks (API key, rate and concurrency limits, drain), route, validation and answer; its caller is
the line's owner (:data:`edge.auth.ON_BEHALF_OF`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
from quart import Quart

from edge.auth import ON_BEHALF_OF

#: The client address a batch line's request has (request lines, per-client limits).
CLIENT = ("batch", 0)


@dataclass(frozen=True)
class Answer:
    """What the app answered: status, ``X-Request-ID`` and the JSON body (text when not JSON)."""

    status: int
    request_id: str
    body: Any


async def send(app: Quart, url: str, body: dict[str, Any], owner: str) -> Answer:
    """POSTs ``body`` to ``url`` on ``app`` as ``owner`` (a key id; ``anonymous`` on an edge
    without API keys) and reads the whole answer."""
    payload = orjson.dumps(body)
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": url,
        "raw_path": url.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"batch.internal"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ],
        "client": CLIENT,
        "server": None,
        "extensions": {},
        ON_BEHALF_OF: owner,
    }
    reader = _Reader(payload)
    writer = _Writer()
    call = asyncio.ensure_future(app(scope, reader.receive, writer.send))  # type: ignore[arg-type]
    try:
        await asyncio.shield(call)
    except asyncio.CancelledError:
        # Cancelling the app's call would leave its handler running (Quart's does not pass a
        # cancellation on): the line's client leaves instead, which ends the request and its
        # worker call as any client's leaving does.
        reader.leave()
        await asyncio.wait([call])
        raise
    return writer.answer()


class _Reader:
    """The request body in one message; then nothing until the caller leaves (a disconnect)."""

    def __init__(self, payload: bytes) -> None:
        self._payload: bytes | None = payload
        self._left = asyncio.Event()

    def leave(self) -> None:
        self._left.set()

    async def receive(self) -> dict[str, Any]:
        if self._payload is None:
            await self._left.wait()
            return {"type": "http.disconnect"}
        payload, self._payload = self._payload, None
        return {"type": "http.request", "body": payload, "more_body": False}


class _Writer:
    """Collects the answer's status, headers and body."""

    def __init__(self) -> None:
        self.status = 0
        self.request_id = ""
        self.body = bytearray()

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            for name, value in message.get("headers", []):
                if name.lower() == b"x-request-id":
                    self.request_id = value.decode()
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")

    def answer(self) -> Answer:
        try:
            body: Any = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            body = self.body.decode("utf-8", "replace")
        return Answer(self.status, self.request_id, body)
