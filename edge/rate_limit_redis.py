"""Rate-limit counters in a Redis that every edge process and pod shares (``--rate-limit-redis-url``):
exact fleet-wide limits, each check one atomic script, streamed tokens added in the background.

Design notes: docs/edge-internals.md, "Rate limits".
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.asyncio import Redis

from edge.rate_limits import KINDS, REQUESTS, TOKENS, WINDOW_S, Decision, KeyLimits, decide

log = logging.getLogger("sluice.edge")

_KEY_PREFIX = "sluice:ratelimit:"
# KEYS: the requests counter, the tokens counter. ARGV: the requests limit (-1: none), the tokens
# limit (-1: none), the window in ms, 1 to count the request. Returns: the refusing counter (0 none,
# 1 requests, 2 tokens), then each counter's use and the ms left of its window (0: none open).
_ADMIT = """
local function read(key)
  local used = tonumber(redis.call('GET', key) or '0')
  local ttl = redis.call('PTTL', key)
  if ttl < 0 then return 0, 0 end
  return used, ttl
end
local req_used, req_ttl = read(KEYS[1])
local tok_used, tok_ttl = read(KEYS[2])
local req_limit, tok_limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local refused = 0
if req_limit >= 0 and req_used >= req_limit then refused = 1
elseif tok_limit >= 0 and tok_used >= tok_limit then refused = 2 end
if refused == 0 and ARGV[4] == '1' and req_limit >= 0 then
  req_used = redis.call('INCR', KEYS[1])
  if req_used == 1 then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    req_ttl = tonumber(ARGV[3])
  end
end
return {refused, req_used, req_ttl, tok_used, tok_ttl}
"""
# KEYS: the tokens counter. ARGV: the tokens, the window in ms. The window opens with the first.
_CHARGE = """
local used = redis.call('INCRBY', KEYS[1], ARGV[1])
if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return used
"""


class RedisCounters:
    """The counters in Redis, under ``sluice:ratelimit:<key digest>:<kind>``; the client connects on
    first use, inside the serving event loop."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._client: Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._pending: dict[str, int] = {}  # tokens not yet sent, per subject
        self._sending: dict[str, asyncio.Task[None]] = {}

    def _script(self, name: str, text: str) -> Any:
        if self._client is None:
            self._client = Redis.from_url(self._url, socket_timeout=2.0, socket_connect_timeout=2.0)
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = self._client.register_script(text)
        return script

    async def admit(self, subject: str, limits: KeyLimits, *, count: bool = True) -> Decision:
        req_limit, tok_limit = (limits.limit(kind) for kind in KINDS)
        reply = await self._script("admit", _ADMIT)(
            keys=[_key(subject, REQUESTS), _key(subject, TOKENS)],
            args=[
                -1 if req_limit is None else req_limit,
                -1 if tok_limit is None else tok_limit,
                int(WINDOW_S * 1000),
                int(count),
            ],
        )
        refused, req_used, req_ttl, tok_used, tok_ttl = (int(v) for v in reply)
        used = {REQUESTS: (req_used, req_ttl / 1000), TOKENS: (tok_used, tok_ttl / 1000)}
        if refused:
            return decide(limits, used, counted=False)
        return decide(limits, used, counted=count)

    def charge(self, subject: str, tokens: int) -> None:
        """Queues ``tokens``; one send per subject at a time, carrying all queued meanwhile."""
        if tokens <= 0:
            return
        self._pending[subject] = self._pending.get(subject, 0) + tokens
        if subject not in self._sending:
            self._sending[subject] = asyncio.get_running_loop().create_task(self._send(subject))

    async def _send(self, subject: str) -> None:
        try:
            while tokens := self._pending.pop(subject, 0):
                await self._script("charge", _CHARGE)(
                    keys=[_key(subject, TOKENS)], args=[tokens, int(WINDOW_S * 1000)]
                )
        except Exception as error:  # an outage loses these tokens, never the request
            self._pending.pop(subject, None)
            log.warning("rate-limit counters unavailable, %s tokens not counted: %s", tokens, error)
        finally:
            self._sending.pop(subject, None)

    async def flushed(self) -> None:
        """Waits until every queued token was sent (tests, shutdown)."""
        while self._sending:
            await asyncio.gather(*self._sending.values(), return_exceptions=True)

    async def close(self) -> None:
        await self.flushed()
        if self._client is not None:
            await self._client.aclose()


def _key(subject: str, kind: str) -> str:
    return f"{_KEY_PREFIX}{subject}:{kind}"
