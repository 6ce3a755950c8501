"""Cross-origin requests from browsers (CORS), for the origins ``--allowed-origins`` lists: preflights
answered, every answer to an allowed origin (errors and streams included) marked for it, and no CORS
header at all for any other origin (its browser then refuses the answer)."""

from __future__ import annotations

import re

from quart import request
from quart.wrappers import Response

ANY = "*"
# What a page may call and read: every method and header the edge serves and answers.
ALLOWED_METHODS = "GET, POST, OPTIONS"
EXPOSED_HEADERS = "X-Request-ID, X-Sluice-Worker-ID, Retry-After"
PREFLIGHT_MAX_AGE_S = 600
# scheme://host[:port], as browsers send it (https://app.example, chrome-extension://abcdef...).
_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^\s/?#]+$")


def parse_origins(raw: str) -> tuple[str, ...]:
    """``--allowed-origins``: comma-separated origins, or ``*`` for any; blanks ignored."""
    origins = tuple(part.strip().rstrip("/") for part in raw.split(",") if part.strip())
    for origin in origins:
        if origin != ANY and not _ORIGIN.match(origin):
            raise ValueError(f"{origin!r} is not an origin (scheme://host[:port], or *)")
    return origins


class Cors:
    """The CORS hooks of one app: :meth:`preflight` before every other hook (a preflight carries
    no API key), :meth:`mark` after every request."""

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any = ANY in origins
        self.origins = frozenset(origins) - {ANY}

    @property
    def enabled(self) -> bool:
        return self.any or bool(self.origins)

    def allow_origin(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for ``origin``; None when it is not allowed."""
        if not origin:
            return None
        if origin in self.origins:
            return origin
        return ANY if self.any else None

    async def preflight(self) -> Response | None:
        """A preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin
        gets 204 at once; anything else goes on to the routes."""
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return None
        allowed = self.allow_origin(request.headers.get("Origin"))
        if allowed is None:
            return None
        response = Response("", status=204)
        response.headers["Access-Control-Allow-Methods"] = ALLOWED_METHODS
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:
            response.headers["Access-Control-Allow-Headers"] = asked
        response.headers["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE_S)
        return response

    async def mark(self, response: Response) -> Response:
        """The allowed origin's headers on ``response``; ``Vary: Origin`` whenever the answer
        depends on the origin (an exact origin echoed, or not allowed while some are)."""
        allowed = self.allow_origin(request.headers.get("Origin"))
        if self.origins:
            response.vary.add("Origin")
        if allowed is None:
            return response
        response.headers["Access-Control-Allow-Origin"] = allowed
        if allowed != ANY:
            # Credentials (cookies, client certificates) only ever for a listed origin, never "*".
            response.headers["Access-Control-Allow-Credentials"] = "true"
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        return response
