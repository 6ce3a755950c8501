"""Per-request time limits: the total deadline and the idle timeout, and the guard that enforces them.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from edge.errors import DeadlineExceededError, EdgeError, InvalidRequestError, StreamIdleTimeoutError
from edge.settings import Settings

TIMEOUT_HEADER = "X-Sluice-Timeout"
IDLE_TIMEOUT_HEADER = "X-Sluice-Idle-Timeout"
# Digits with an optional fraction: no signs, exponents, "inf" or "nan".
_SECONDS = re.compile(r"^[0-9]{1,9}(\.[0-9]{1,9})?$")

T = TypeVar("T")


@dataclass(frozen=True)
class TimeLimits:
    """The time limits of one request, in seconds (both positive and finite)."""

    total_s: float
    idle_s: float


def parse_seconds_header(name: str, value: str | None, default: float, cap: float) -> float:
    """A timeout header's value in seconds: ``default`` when absent, clamped to ``cap``.

    Raises :class:`InvalidRequestError` (``param`` is the header name) when the
    value is not a plain positive decimal number of seconds.
    """
    if value is None:
        return default
    text = value.strip()
    if not _SECONDS.match(text) or float(text) <= 0:
        raise InvalidRequestError(
            f"The {name} header must be a positive number of seconds (for example 30 or 2.5), "
            f"got {value[:40]!r}.",
            param=name,
            code="invalid_header",
        )
    return min(float(text), cap)


def request_limits(timeout: str | None, idle_timeout: str | None, settings: Settings) -> TimeLimits:
    """The limits for a request whose ``X-Sluice-Timeout`` / ``X-Sluice-Idle-Timeout`` headers are
    ``timeout`` / ``idle_timeout`` (``None`` when absent); raises a 400 on a bad value."""
    return TimeLimits(
        total_s=parse_seconds_header(
            TIMEOUT_HEADER, timeout, settings.request_timeout_s, settings.max_request_timeout_s
        ),
        idle_s=parse_seconds_header(
            IDLE_TIMEOUT_HEADER, idle_timeout, settings.idle_timeout_s, settings.max_idle_timeout_s
        ),
    )


class EventGuard:
    """Enforces one request's :class:`TimeLimits` on its worker events.

    Build it when the request starts (the total deadline counts from then),
    then iterate :meth:`watch` once. Only the wait for the next event is
    timed: the time a consumer spends between events (writing to a slow
    client) is not idle time of the worker, and a consumer is never
    interrupted while it does something else.
    """

    def __init__(
        self,
        limits: TimeLimits,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        deadline: float | None = None,
    ) -> None:
        self.limits = limits
        self._loop = loop or asyncio.get_running_loop()
        # The total deadline counts from the request's start: an explicit one, else now.
        self._deadline = deadline if deadline is not None else self._loop.time() + limits.total_s
        self._stop_error: EdgeError | None = None
        self._timer: asyncio.Timeout | None = None

    @property
    def deadline(self) -> float:
        """The total deadline, in the event loop's clock."""
        return self._deadline

    def stop(self, error: EdgeError) -> None:
        """Ends :meth:`watch` with ``error``: at once if it is waiting for an event, else at its
        next wait. The first call wins; later ones are ignored. Safe to call from any callback
        on the guard's loop."""
        if self._stop_error is not None:
            return
        self._stop_error = error
        if self._timer is not None:
            self._timer.reschedule(self._loop.time())

    async def watch(self, events: AsyncIterable[T]) -> AsyncIterator[T]:
        """Yields ``events`` until they end, or raises the limit's :class:`EdgeError`.

        On a limit the pending read is cancelled (so the source's own cleanup,
        cancelling its worker calls, has run) before the error is raised. When
        this generator is closed early, ``events`` is closed too.
        """
        source = aiter(events)
        try:
            while True:
                if self._stop_error is not None:
                    raise self._stop_error
                idle_end = self._loop.time() + self.limits.idle_s
                try:
                    async with asyncio.timeout_at(min(idle_end, self._deadline)) as timer:
                        self._timer = timer
                        event = await anext(source)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if not timer.expired():
                        raise  # the source's own timeout, not ours
                    raise self._limit_error(idle_end) from None
                finally:
                    self._timer = None
                yield event
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    def deadline_error(self) -> DeadlineExceededError:
        """The error for a request whose total deadline passed."""
        return deadline_error(self.limits)

    def _limit_error(self, idle_end: float) -> EdgeError:
        if self._stop_error is not None:
            return self._stop_error
        if self._deadline <= idle_end:
            return self.deadline_error()
        return idle_timeout_error(self.limits)


def deadline_error(limits: TimeLimits) -> DeadlineExceededError:
    """The error for a request whose total deadline (``limits.total_s``) passed."""
    return DeadlineExceededError(
        f"The request exceeded its deadline of {_seconds(limits.total_s)} "
        f"(set with the {TIMEOUT_HEADER} header, up to the server's maximum).",
        code="timeout",
    )


def idle_timeout_error(limits: TimeLimits) -> StreamIdleTimeoutError:
    """The error for a request whose workers sent nothing for ``limits.idle_s``."""
    return StreamIdleTimeoutError(
        f"The model worker sent nothing for {_seconds(limits.idle_s)} "
        f"(set with the {IDLE_TIMEOUT_HEADER} header, up to the server's maximum).",
    )


def _seconds(value: float) -> str:
    return f"{value:g} s"
