"""Client connections: the write timeout for clients that stop reading, and the final abort at shutdown.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol, TypeGuard, cast

import h11
from h11._writers import ChunkedWriter
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, ASGISendEvent, Scope

log = logging.getLogger("sluice.edge")

ASGIApp = Callable[[Scope, ASGIReceiveCallable, ASGISendCallable], Awaitable[None]]
# ASGI scope keys (an app may keep its own keys in the scope): the connection's transport, and
# the flag a streamed response sets when its pump times its body writes itself.
_TRANSPORT_KEY = "sluice.transport"
_PUMP_TIMES_WRITES_KEY = "sluice.pump_times_writes"
_CHUNKED_BODY_KEY = "sluice.chunked_body"
# How deep to look through hypercorn's bound ``send`` methods for the connection.
_MAX_HOPS = 6


class ClientTransport(Protocol):
    """What the edge uses of a client connection's transport. asyncio's own transports derive
    from :class:`asyncio.WriteTransport`; uvloop's (:mod:`edge.event_loop`) have the same methods
    without deriving from it, so the edge checks for the methods, not the class."""

    def abort(self) -> None: ...

    def is_closing(self) -> bool: ...


def is_client_transport(candidate: Any) -> TypeGuard[ClientTransport]:
    """Whether ``candidate`` has a :class:`ClientTransport`'s methods (what a runtime-checkable
    protocol checks, at a tenth of its cost: this runs for every request)."""
    return callable(getattr(candidate, "abort", None)) and callable(getattr(candidate, "is_closing", None))


def transport_of(send: Callable[..., Any]) -> ClientTransport | None:
    """The transport behind hypercorn's ASGI ``send`` callable, or ``None`` if not found."""
    writer, _ = _connection_of(send)
    return writer.transport if writer is not None else None


def _connection_of(send: Callable[..., Any]) -> tuple[asyncio.StreamWriter | None, h11.Connection | None]:
    """The connection's ``StreamWriter`` behind hypercorn's ASGI ``send`` callable, and its h11
    connection where it speaks HTTP/1.1 (``None`` for what is not found).

    hypercorn (0.14 to at least 0.18) hands the app ``HTTPStream.app_send``,
    whose stream sends through the protocol's ``send`` (``H11Protocol``, which
    owns the h11 ``connection``, or ``H2Protocol``), whose ``send`` is
    ``TCPServer.protocol_send``, which owns the connection's ``writer``. These
    are private attributes, so this follows them defensively (bound method →
    owner → its ``send``) and returns ``None`` for any other shape; the tests
    prove the path.
    """
    current: Any = send
    connection: h11.Connection | None = None
    for _ in range(_MAX_HOPS):
        owner = getattr(current, "__self__", None)
        if owner is None:
            break
        candidate = getattr(owner, "connection", None)
        if isinstance(candidate, h11.Connection):
            connection = candidate
        writer = getattr(owner, "writer", None)
        if isinstance(writer, asyncio.StreamWriter) and is_client_transport(writer.transport):
            return writer, connection
        current = getattr(owner, "send", None)
    return None, None


class ChunkedBody:
    """The body of one HTTP/1.1 response written straight to its connection, one chunk of the
    chunked transfer coding per :meth:`write` (docs/edge-internals.md,
    "Client connections")."""

    def __init__(self, writer: asyncio.StreamWriter, connection: h11.Connection) -> None:
        self._writer = writer
        self._connection = connection

    def usable(self) -> bool:
        """Whether the response's head went out with the chunked coding and its body is open
        (checked once the head was sent: h11 picks the coding from the response's headers)."""
        connection = self._connection
        return (
            connection.our_state is h11.SEND_BODY
            and isinstance(getattr(connection, "_writer", None), ChunkedWriter)
            and not self._writer.transport.is_closing()
        )

    def closing(self) -> bool:
        """Whether the connection is closed or closing (the client went away, or was cut)."""
        return self._writer.transport.is_closing()

    def write(self, data: bytes) -> None:
        """Queues ``data`` (not empty) as one chunk; never blocks."""
        self._writer.write(b"%x\r\n%b\r\n" % (len(data), data))

    def needs_drain(self) -> bool:
        """Whether bytes wait in the connection's buffer (the client has not taken them yet)."""
        return self._writer.transport.get_write_buffer_size() > 0

    async def drain(self) -> None:
        """Returns once the connection's buffer is below its high-water mark (at once when it
        is); raises ``ConnectionError`` when the connection was lost."""
        await self._writer.drain()


class ClientConnections:
    """ASGI middleware: a ``send`` slower than ``write_timeout_s`` aborts its connection.

    Over HTTP/2 a stalled stream aborts the client's whole connection (its
    other streams included): a client that stops reading one stream usually
    stops reading the connection. Where the transport cannot be found
    (another server), the task blocked in
    ``send`` is cancelled instead: the response ends and its worker calls are
    cancelled, but the connection may stay open until the client reads or
    goes away.
    """

    def __init__(self, app: ASGIApp, write_timeout_s: float) -> None:
        self.app = app
        self.write_timeout_s = write_timeout_s
        self._transports: weakref.WeakSet[ClientTransport] = weakref.WeakSet()

    def abort_all(self) -> int:
        """Aborts every known connection still open (the last step of a shutdown, after the
        streams were ended and had time to write their last frames); returns how many."""
        open_ones = [t for t in self._transports if not t.is_closing()]
        for transport in open_ones:
            transport.abort()
        return len(open_ones)

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        writer, connection = _connection_of(send)
        transport = writer.transport if writer is not None else None
        extra = _extra(scope)
        if writer is not None and transport is not None:
            self._transports.add(transport)
            extra[_TRANSPORT_KEY] = transport
            if connection is not None:
                extra[_CHUNKED_BODY_KEY] = ChunkedBody(writer, connection)
        loop = asyncio.get_running_loop()
        timeout_s = self.write_timeout_s

        async def timed_send(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.body" and extra.get(_PUMP_TIMES_WRITES_KEY):
                await send(message)
                return
            task = asyncio.current_task()

            def on_stall() -> None:
                log.warning(
                    "client %s accepted no response bytes for %.1f s; closing the connection",
                    _client(scope),
                    timeout_s,
                )
                if transport is not None:
                    transport.abort()  # drops the unsent bytes and closes the socket now
                elif task is not None:
                    task.cancel()

            handle = loop.call_later(timeout_s, on_stall)
            try:
                await send(message)
            finally:
                handle.cancel()

        await self.app(scope, receive, timed_send)


def scope_transport(scope: Any) -> ClientTransport | None:
    """The transport of the connection behind ``scope`` (None when not found), and from now on
    the body writes of that request are left to the caller to time (its stream pump)."""
    extra = _extra(scope)
    extra[_PUMP_TIMES_WRITES_KEY] = True
    transport = extra.get(_TRANSPORT_KEY)
    return transport if is_client_transport(transport) else None


def scope_chunked_body(scope: Any) -> ChunkedBody | None:
    """How to write the body of the request behind ``scope`` straight to its HTTP/1.1
    connection, or None (HTTP/2, another server); the caller checks :meth:`ChunkedBody.usable`
    once the response's head is out."""
    body = _extra(scope).get(_CHUNKED_BODY_KEY)
    return body if isinstance(body, ChunkedBody) else None


def _extra(scope: Any) -> MutableMapping[str, Any]:
    return cast(MutableMapping[str, Any], scope)


def _client(scope: Scope) -> str:
    client = scope.get("client")
    if isinstance(client, list | tuple) and len(client) == 2:
        return f"{client[0]}:{client[1]}"
    return "?"
