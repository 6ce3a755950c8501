"""Optional API keys: ``Authorization: Bearer <key>`` on every ``/v1/*`` request.

Off when the edge has no keys (``--api-keys`` / ``--api-keys-file`` unset).
When on, a request under ``/v1/`` without a matching key is answered 401 with
OpenAI's body (``type: invalid_request_error``, ``code: invalid_api_key``)
before its body is read or a route runs, so an unauthenticated caller learns
nothing (not even whether a route exists). ``/health``, ``/ready`` and
``/openapi.json`` stay open for probes and tooling.

Keys are compared in constant time against every configured key (no early
exit), and are never logged or echoed.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from quart import request

from edge.errors import AuthenticationError

PROTECTED_PREFIX = "/v1/"
_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_WRONG = "Incorrect API key provided."


class ApiKeyCheck:
    """Checks bearer tokens against a fixed set of keys."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(key.encode("utf-8") for key in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def matches(self, token: str) -> bool:
        """True when ``token`` equals one of the keys. Every key is compared, in constant time."""
        given = token.encode("utf-8")
        found = False
        for key in self._keys:
            found |= hmac.compare_digest(given, key)
        return found

    def check(self, path: str, authorization: str | None) -> None:
        """Raises :class:`AuthenticationError` when ``path`` needs a key and ``authorization``
        (the raw header value) does not carry a valid one."""
        if not self.enabled or not path.startswith(PROTECTED_PREFIX):
            return
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError(_MISSING)
        if not self.matches(token):
            raise AuthenticationError(_WRONG)

    async def before_request(self) -> None:
        """Quart ``before_request`` hook (registered after the request id is assigned)."""
        self.check(request.path, request.headers.get("Authorization"))
