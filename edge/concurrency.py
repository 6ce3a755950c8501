"""The per-caller concurrency limit on generation requests (``--max-concurrent-per-key``).

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast

from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from quart import request

from edge.auth import caller_identity
from edge.errors import BODY_UNREAD, RateLimitError

# Endpoints (blueprint.function) whose requests hold a slot while they run.
GENERATION_ENDPOINTS = frozenset(
    {
        "chat.chat_completions",
        "completions.completions",
        "infill.infill",
        "responses.create_response",
        "messages.create_message",
        "native.chat",
        # Pooled work holds worker capacity too.
        "embeddings.embeddings",
        "scores.rerank",
        "scores.rerank_v1",
        "scores.rerank_v2",
        "scores.score",
    }
)
_SCOPE_KEY = "sluice.concurrency_slot"

AsgiApp = Callable[[Scope, ASGIReceiveCallable, ASGISendCallable], Awaitable[None]]


class Slot:
    """One held slot; :meth:`release` gives it back once (later calls do nothing)."""

    def __init__(self, limiter: ConcurrencyLimiter, identity: str) -> None:
        self._limiter = limiter
        self.identity = identity
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limiter._release(self.identity)


class ConcurrencyLimiter:
    """Counts slots per identity, within one event loop. ``limit`` 0 turns the limit off."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self._held: dict[str, int] = {}
        self.rejected = 0

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def in_use(self, identity: str | None = None) -> int:
        """Slots held by ``identity``, or by everyone."""
        if identity is None:
            return sum(self._held.values())
        return self._held.get(identity, 0)

    def try_acquire(self, identity: str) -> Slot | None:
        """A slot for ``identity``, or None (counted in :attr:`rejected`) when it holds ``limit``."""
        held = self._held.get(identity, 0)
        if held >= self.limit:
            self.rejected += 1
            return None
        self._held[identity] = held + 1
        return Slot(self, identity)

    def _release(self, identity: str) -> None:
        left = self._held.get(identity, 0) - 1
        if left > 0:
            self._held[identity] = left
        else:
            # No entry for idle callers, so the table stays as small as the active set.
            self._held.pop(identity, None)

    async def before_request(self) -> None:
        """Quart hook: takes a slot for a generation request, or raises the 429."""
        if request.endpoint not in GENERATION_ENDPOINTS:
            return
        identity = caller_identity()
        slot = self.try_acquire(identity)
        if slot is None:
            who = "API key" if identity.startswith("key#") else "client"
            refused = RateLimitError(
                f"Too many concurrent requests: at most {self.limit} generation requests may be in "
                f"flight per {who}. Retry when one has finished.",
                code="concurrency_limit_exceeded",
                retry_after=1.0,
            )
            refused.extra_headers.update(BODY_UNREAD)
            raise refused
        _extra(request.scope)[_SCOPE_KEY] = slot


class ReleaseSlots:
    """ASGI wrapper around the Quart app: releases the request's slot when the exchange ends."""

    def __init__(self, app: AsgiApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        try:
            await self._app(scope, receive, send)
        finally:
            slot = _extra(scope).pop(_SCOPE_KEY, None)
            if isinstance(slot, Slot):
                slot.release()


def _extra(scope: Any) -> MutableMapping[str, Any]:
    """The scope as a plain mapping: ASGI lets an app keep its own keys in it (typed scopes do not)."""
    return cast(MutableMapping[str, Any], scope)
