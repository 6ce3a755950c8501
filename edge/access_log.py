"""hypercorn's access log with each line's fields computed only when its format asks for them.

hypercorn's own logger builds every field of a line before formatting it, among them one per
request header, per response header and per environment variable of the process: about a tenth
of the edge's CPU for a short streamed request (docs/benchmarks.md). The lines are the same.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from hypercorn.logging import AccessLogAtoms, Logger


class AccessLogger(Logger):
    """hypercorn's logger (``Config.logger_class``) with lazily computed access-log fields."""

    def atoms(self, request: Any, response: Any, request_time: float) -> Mapping[str, str]:
        return LazyAtoms(request, response, request_time)


class LazyAtoms(Mapping[str, Any]):
    """The fields of hypercorn's default access format (``h l t r s b f a``) computed on demand,
    as hypercorn computes them; any other field from hypercorn's own full set, built once."""

    def __init__(self, request: Any, response: Any, request_time: float) -> None:
        self._request, self._response, self._request_time = request, response, request_time
        self._full: AccessLogAtoms | None = None

    def __getitem__(self, key: str) -> Any:
        request, response = self._request, self._response
        if key == "h":
            client = request.get("client")
            if client is not None and len(client) == 2:
                return f"{client[0]}:{client[1]}"
        elif key == "l":
            return "-"
        elif key == "t":
            return time.strftime("[%d/%b/%Y:%H:%M:%S %z]")
        elif key == "r":
            method = request["method"] if request["type"] == "http" else "GET"
            return f"{method} {request['path']} {request.get('http_version', 'ws')}"
        elif key == "s":
            return str(response["status"]) if response is not None else "-"
        elif key in ("b", "B"):
            return _header(response.get("headers", ()) if response is not None else (), b"content-length")
        elif key == "f":
            return _header(request["headers"], b"referer")
        elif key == "a":
            return _header(request["headers"], b"user-agent")
        return self._everything()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._everything())

    def __len__(self) -> int:
        return len(self._everything())

    def __bool__(self) -> bool:
        return True  # logging takes a mapping argument only when it is truthy: never build it for that

    def _everything(self) -> AccessLogAtoms:
        if self._full is None:
            self._full = AccessLogAtoms(self._request, self._response, self._request_time)
        return self._full


def _header(headers: Any, name: bytes) -> str:
    """A header's value as hypercorn's atoms give it (the last one of that name), else "-"."""
    found = "-"
    for key, value in headers:
        if key.lower() == name:
            found = value.decode("latin1")
    return found
