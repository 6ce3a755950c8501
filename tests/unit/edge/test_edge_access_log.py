"""The edge's access log fields (edge/access_log.py) against hypercorn's own, format by format."""

from __future__ import annotations

import pytest
from hypercorn.config import Config
from hypercorn.logging import AccessLogAtoms

from edge.access_log import LazyAtoms

REQUEST = {
    "type": "http",
    "http_version": "1.1",
    "method": "POST",
    "scheme": "http",
    "path": "/v1/chat/completions",
    "query_string": b"a=1",
    "client": ("127.0.0.1", 5555),
    "headers": [(b"User-Agent", b"OpenAI/Python 2.8.1"), (b"referer", b"http://x/"), (b"X-Two", b"1")],
}
RESPONSE = {"status": 200, "headers": [(b"content-type", b"text/event-stream"), (b"content-length", b"17")]}
FORMATS = [
    Config.access_log_format,  # the edge's: hypercorn's default
    '%(h)s "%(R)s" %(st)s %(S)s %(m)s %(U)s %(Uq)s %(q)s %(H)s %(B)s %(T)s %(D)s %(p)s',
    "%({x-two}i)s %({content-type}o)s %({missing}i)s %({home}e)s %(nothing)s",
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("request_", "response"),
    [
        (REQUEST, RESPONSE),
        ({**REQUEST, "headers": [], "client": None}, None),
        ({**REQUEST, "client": ("/tmp/socket",)}, {"status": 499, "headers": []}),
    ],
)
def test_each_line_is_hypercorns(
    fmt: str, request_: dict, response: dict | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("time.strftime", lambda _: "[30/Nov/2026:08:00:00 +0000]")  # one second for both
    lazy, full = LazyAtoms(request_, response, 0.25), AccessLogAtoms(request_, response, 0.25)  # type: ignore[arg-type]
    assert fmt % lazy == fmt % full
    assert bool(lazy) and dict(lazy) == dict(full)
