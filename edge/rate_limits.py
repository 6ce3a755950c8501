"""Per-key rate limits (``requests_per_minute``, ``tokens_per_minute`` in ``--api-keys-file``): the
counters' windows, the admission check, the ``x-ratelimit-*`` / ``anthropic-ratelimit-*`` headers
and the tokens a request streams, counted against its key as they arrive.

Design notes: docs/edge-internals.md, "Rate limits"; the counters shared over Redis: rate_limit_redis.py.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from quart import g, request
from quart.wrappers import Response

from edge.auth import PROTECTED_PREFIXES
from edge.concurrency import GENERATION_ENDPOINTS
from edge.errors import BODY_UNREAD, RateLimitError
from edge.requests.errors import ANTHROPIC_PREFIX
from sluice.v1 import worker_pb2

log = logging.getLogger("sluice.edge")

#: Every counter's window: it opens with the first request (or token) counted and lasts a minute.
WINDOW_S = 60.0
#: The two kinds of limit, as OpenAI names them (the error's ``type``, the headers' suffixes).
REQUESTS, TOKENS = "requests", "tokens"
KINDS = (REQUESTS, TOKENS)
#: The fields an ``--api-keys-file`` line may give after its key.
KEY_FIELDS = ("requests_per_minute", "tokens_per_minute")
_TICKET = "sluice_rate_limit"
_WARN_EVERY_S = 30.0


@dataclass(frozen=True)
class KeyLimits:
    """One API key's limits per minute; None: not limited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def limit(self, kind: str) -> int | None:
        return self.requests_per_minute if kind == REQUESTS else self.tokens_per_minute


@dataclass(frozen=True)
class Quota:
    """One counter as its caller sees it: the limit, what is left, seconds until the window resets
    (0 when no window is open)."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True)
class Decision:
    """What an admission check found: each limited counter's quota, and the kind that refused the
    request (None: admitted)."""

    quotas: Mapping[str, Quota]
    refused: str | None = None

    @property
    def retry_after_s(self) -> float:
        """Seconds until the refusing counter's window resets (0 when admitted)."""
        return self.quotas[self.refused].reset_s if self.refused else 0.0


def decide(limits: KeyLimits, used: Mapping[str, tuple[int, float]], *, counted: bool) -> Decision:
    """The decision from each counter's ``(used, reset_s)`` as read before the check; ``counted``:
    the request was admitted and counted (its request is in ``used`` already)."""
    quotas, refused = {}, None
    for kind in KINDS:
        limit = limits.limit(kind)
        if limit is None:
            continue
        count, reset_s = used.get(kind, (0, 0.0))
        quotas[kind] = Quota(limit, max(0, limit - count), reset_s)
    if not counted:
        refused = next((k for k in KINDS if k in quotas and quotas[k].remaining <= 0), None)
    return Decision(quotas, refused)


class CounterStore(Protocol):
    """Where the counters live: this process (:class:`LocalCounters`) or a Redis every edge
    process shares (:class:`edge.rate_limit_redis.RedisCounters`)."""

    async def admit(self, subject: str, limits: KeyLimits, *, count: bool = True) -> Decision:
        """Refuses when a counter of ``subject`` is spent; else counts the request (with ``count``),
        atomically. ``count=False`` only reads (the headers of an answer that takes no quota)."""
        ...

    def charge(self, subject: str, tokens: int) -> None:
        """Adds ``tokens`` to ``subject``'s token counter (opening its window if none is open)."""
        ...

    async def close(self) -> None: ...


@dataclass
class _Window:
    ends_at: float
    used: int = 0


class LocalCounters:
    """The counters of one edge process: exact within it (one event loop, no awaits inside)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # One entry per (subject, kind) of the keys in use: bounded by the keys file.
        self._windows: dict[tuple[str, str], _Window] = {}

    def _read(self, subject: str, kind: str, now: float) -> tuple[int, float]:
        window = self._windows.get((subject, kind))
        if window is None or window.ends_at <= now:
            return 0, 0.0
        return window.used, window.ends_at - now

    def _add(self, subject: str, kind: str, amount: int, now: float) -> None:
        window = self._windows.get((subject, kind))
        if window is None or window.ends_at <= now:
            window = self._windows[(subject, kind)] = _Window(now + WINDOW_S)
        window.used += amount

    async def admit(self, subject: str, limits: KeyLimits, *, count: bool = True) -> Decision:
        now = self._clock()
        used = {kind: self._read(subject, kind, now) for kind in KINDS}
        decision = decide(limits, used, counted=False)
        if decision.refused or not count:
            return decision
        if limits.requests_per_minute is not None:
            self._add(subject, REQUESTS, 1, now)
            used[REQUESTS] = self._read(subject, REQUESTS, now)
        return decide(limits, used, counted=True)

    def charge(self, subject: str, tokens: int) -> None:
        if tokens > 0:
            self._add(subject, TOKENS, tokens, self._clock())

    async def close(self) -> None:
        return None


def key_subject(key: str) -> str:
    """The name a key's counters go by: a digest, so that no store ever holds the key, and the same
    in every edge process and pod that has the key (whatever its position in their files)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


def openai_duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: ``250ms``, ``12.5s``, ``1m0s``."""
    millis = max(0, math.ceil(seconds * 1000))
    if millis < 1000:
        return f"{millis}ms"
    minutes, rest = divmod(millis, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def rate_limit_headers(decision: Decision, *, anthropic: bool, now: float | None = None) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers, or Anthropic's ``anthropic-ratelimit-*`` (reset as an
    RFC 3339 time; ``now``: the wall clock, for tests), one set per limited counter."""
    headers = {}
    for kind, quota in decision.quotas.items():
        if anthropic:
            wall = datetime.datetime.fromtimestamp(now if now is not None else time.time(), datetime.UTC)
            reset = wall + datetime.timedelta(seconds=math.ceil(quota.reset_s))
            prefix = f"anthropic-ratelimit-{kind}"
            headers[f"{prefix}-limit"] = str(quota.limit)
            headers[f"{prefix}-remaining"] = str(quota.remaining)
            headers[f"{prefix}-reset"] = reset.strftime("%Y-%m-%dT%H:%M:%SZ")
        else:
            headers[f"x-ratelimit-limit-{kind}"] = str(quota.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(quota.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = openai_duration(quota.reset_s)
    return headers


class KeyRateLimitError(RateLimitError):
    """A key over its requests or tokens per minute: OpenAI's 429 (``type`` is the kind, as OpenAI's
    own answers have it; Anthropic's ``rate_limit_error`` on /v1/messages)."""

    def __init__(self, decision: Decision) -> None:
        kind = decision.refused or REQUESTS
        quota = decision.quotas[kind]
        unit = "requests per minute (RPM)" if kind == REQUESTS else "tokens per minute (TPM)"
        super().__init__(
            f"Rate limit reached for this API key on {unit}: Limit {quota.limit}, Used "
            f"{quota.limit - quota.remaining}. Please try again in {openai_duration(quota.reset_s)}.",
            code="rate_limit_exceeded",
            retry_after=decision.retry_after_s,
        )
        self.type = kind
        self.extra_headers.update(BODY_UNREAD)


class TokenMeter:
    """Charges a request's tokens to its key as its worker events arrive: each call's prompt at
    ``started``, generated tokens with each delta's ids, the rest of a choice at ``finished``."""

    def __init__(self, charge: Callable[[int], None]) -> None:
        self.charge = charge
        self._counted: dict[tuple[int, int], int] = {}

    def observe(self, call: int, event: worker_pb2.GenerateResponse) -> None:
        """Counts one event of worker call ``call``."""
        kind = event.WhichOneof("event")
        if kind in ("content", "reasoning", "tool_call"):
            delta = getattr(event, kind)
            if delta.token_ids:
                self._count(call, delta.choice_index, len(delta.token_ids))
        elif kind == "started":
            self.charge(event.started.prompt_tokens)
        elif kind == "finished":
            done = event.finished
            self._count(
                call,
                done.choice_index,
                done.completion_tokens - self._counted.get((call, done.choice_index), 0),
            )

    def _count(self, call: int, choice: int, tokens: int) -> None:
        if tokens > 0:
            self._counted[(call, choice)] = self._counted.get((call, choice), 0) + tokens
            self.charge(tokens)


@dataclass
class _Ticket:
    """The current request's key and what its check found (in Quart's ``g``)."""

    subject: str
    limits: KeyLimits
    decision: Decision | None = None
    checked: bool = False  # the store was asked (None above: it failed)
    meter: TokenMeter | None = None


class RateLimitCounts(Protocol):
    """Where refusals are counted (:class:`edge.metrics.EdgeMetrics`)."""

    def rate_limited(self, kind: str) -> None: ...


class RateLimiter:
    """The Quart hooks of the rate limits: the check before a generation request, the headers on
    every answer to a limited key. ``limits`` maps an API key's position to its key and limits."""

    def __init__(
        self, limits: Mapping[int, tuple[str, KeyLimits]], store: CounterStore, counts: RateLimitCounts
    ):
        self._subjects = {i: (key_subject(key), lim) for i, (key, lim) in limits.items() if lim.limited}
        self.store = store
        self._counts = counts
        self._warned_at = -math.inf

    async def identify(self) -> None:
        """Quart hook (after the key check, before the concurrency limit): notes a limited key's
        request, so that every answer to it has the headers, a refusal by another limit included."""
        entry = self._subjects.get(g.get("api_key_index", -1))
        if entry is not None and request.path.startswith(PROTECTED_PREFIXES):
            setattr(g, _TICKET, _Ticket(*entry))

    async def check(self) -> None:
        """Quart hook (after the concurrency limit): counts a generation request of a limited key,
        or raises its 429."""
        ticket: _Ticket | None = g.get(_TICKET)
        if ticket is None or request.endpoint not in GENERATION_ENDPOINTS:
            return
        ticket.decision, ticket.checked = await self._guarded(ticket, count=True), True
        if ticket.decision is not None and ticket.decision.refused:
            self._counts.rate_limited(ticket.decision.refused)
            raise KeyRateLimitError(ticket.decision)
        if ticket.limits.tokens_per_minute is not None:
            store, subject = self.store, ticket.subject
            ticket.meter = TokenMeter(lambda tokens: store.charge(subject, tokens))

    async def after_request(self, response: Response) -> Response:
        """Quart hook: the limited key's headers on every answer (a read of the counters when the
        request took no quota)."""
        ticket: _Ticket | None = g.get(_TICKET)
        if ticket is None:
            return response
        decision = ticket.decision if ticket.checked else await self._guarded(ticket, count=False)
        if decision is not None:
            anthropic = request.path == ANTHROPIC_PREFIX or request.path.startswith(ANTHROPIC_PREFIX + "/")
            response.headers.update(rate_limit_headers(decision, anthropic=anthropic))
        return response

    async def _guarded(self, ticket: _Ticket, *, count: bool) -> Decision | None:
        """The store's answer; None (the request goes on unlimited) when the store fails: an outage
        of a shared counter must not stop serving (logged, docs/operations.md)."""
        try:
            return await self.store.admit(ticket.subject, ticket.limits, count=count)
        except Exception as error:  # the store's client raises its own errors
            now = time.monotonic()
            if now - self._warned_at >= _WARN_EVERY_S:  # one line per outage, not one per request
                self._warned_at = now
                log.warning("rate-limit counters unavailable, requests admitted unlimited: %s", error)
            return None


def request_meter() -> TokenMeter | None:
    """The current request's token meter: set when its key has a tokens-per-minute limit."""
    ticket: _Ticket | None = g.get(_TICKET)
    return ticket.meter if ticket is not None else None
