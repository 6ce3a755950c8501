"""Optional API keys: ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as Anthropic's
clients send it) on every ``/v1/*`` and ``/api/v1/*`` request.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from typing import Any, cast

from quart import g, request

from edge.errors import AuthenticationError

PROTECTED_PREFIXES = ("/v1/", "/api/v1/", "/tokenize", "/detokenize", "/infill")
_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or in an x-api-key header."
)
_WRONG = "Incorrect API key provided."
#: Who owns what a request stores when the edge has no API keys: every caller alike.
ANONYMOUS = "anonymous"
#: The ASGI scope key of a request the edge sends itself on behalf of a key (a batch line): the
#: key's id. Only the edge puts keys in a scope: no client can set it.
ON_BEHALF_OF = "sluice.on_behalf_of"
_GONE = "The API key that created this batch is no longer accepted."


def key_id(key: str) -> str:
    """A key's stable, non-secret id: the first 16 hex digits of its SHA-256 (stored responses'
    owner, request logs); the same on every edge and across restarts and key-file reorders."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


class ApiKeyCheck:
    """Checks bearer tokens against a fixed set of keys, and knows each key's tenant."""

    def __init__(self, keys: Iterable[str], tenants: Mapping[str, str] | None = None) -> None:
        """``tenants``: key -> tenant; a key without one is its own tenant, ``key#N`` (its position)."""
        keys = tuple(keys)
        self._keys = tuple(key.encode("utf-8") for key in keys)
        self._tenants = tuple((tenants or {}).get(key) or f"key#{index}" for index, key in enumerate(keys))
        self._ids = tuple(key_id(key) for key in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def matches(self, token: str) -> bool:
        """True when ``token`` equals one of the keys. Every key is compared, in constant time."""
        return self.match_index(token) is not None

    def match_index(self, token: str) -> int | None:
        """The position of the key ``token`` equals, or None. Every key is compared, in
        constant time (the index is picked without a branch on the comparison)."""
        given = token.encode("utf-8")
        found = -1
        for index, key in enumerate(self._keys):
            equal = hmac.compare_digest(given, key)
            # Keys are distinct after settings dedupe them, so at most one is equal.
            found = max(found, index * equal - (not equal))
        return found if found >= 0 else None

    def check(self, path: str, authorization: str | None, api_key: str | None = None) -> int | None:
        """Raises :class:`AuthenticationError` when ``path`` needs a key and neither
        ``authorization`` (the raw header value) nor ``api_key`` (the ``x-api-key``
        header, Anthropic's way) carries a valid one; returns the matched key's position
        (None when no key was needed). A bearer token, when present, is the one checked."""
        if not self.enabled or not path.startswith(PROTECTED_PREFIXES):
            return None
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            token = (api_key or "").strip()
        if not token:
            raise AuthenticationError(_MISSING)
        index = self.match_index(token)
        if index is None:
            raise AuthenticationError(_WRONG)
        return index

    async def before_request(self) -> None:
        """Quart ``before_request`` hook (registered after the request id is assigned);
        records the matched key's position for :func:`caller_identity` and its id for
        :func:`caller_key_id`."""
        behalf = cast(Mapping[str, Any], request.scope).get(ON_BEHALF_OF)
        if behalf is not None:
            index = self._ids.index(behalf) if behalf in self._ids else None
            if index is None:
                raise AuthenticationError(_GONE)
        else:
            index = self.check(
                request.path, request.headers.get("Authorization"), request.headers.get("x-api-key")
            )
        if index is not None:
            g.api_key_index = index
            g.api_key_id = self._ids[index]
            g.api_key_tenant = self._tenants[index]


def caller_tenant() -> str:
    """The tenant a request counts against on the workers, inside a request context: its API key's
    (set by the check, never by the caller); empty without API keys (everyone shares one)."""
    tenant: str = g.get("api_key_tenant", "")
    return tenant


def caller_identity() -> str:
    """Who a request counts against for per-caller limits, inside a request context.

    ``key#N`` (the position of the caller's API key) when the request was
    authenticated, else ``client:<peer address>``. The peer is the TCP peer:
    ``X-Forwarded-For`` is deliberately ignored, as any caller can forge it;
    behind a proxy every request shares the proxy's address (use API keys there).
    """
    index = g.get("api_key_index")
    if index is not None:
        return f"key#{index}"
    return f"client:{request.remote_addr or 'unknown'}"


def caller_key_id() -> str:
    """The id (:func:`key_id`) of the API key the current request was authenticated with, or
    :data:`ANONYMOUS` when the edge has no keys: the owner of what the request stores."""
    found: str | None = g.get("api_key_id")
    return found if found is not None else ANONYMOUS
