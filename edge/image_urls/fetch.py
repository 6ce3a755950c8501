"""One image fetched from an ``http(s)`` URL (``--allow-image-urls``): the host resolved, every
address checked (:mod:`edge.image_urls.policy`), the connection made to a checked address (so a
second DNS answer cannot swap in another), redirects followed only through the same checks, the
body bounded in bytes and the whole fetch in time. Notes: docs/edge-internals.md, "Images"."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

import h11

from edge.image_urls.policy import IPAddress, is_public_address, parse_address

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_READ_BYTES = 64 * 1024

Resolver = Callable[[str, int], Awaitable[list[str]]]


class ImageFetchError(Exception):
    """An image URL that could not be fetched; the message is written for the caller."""


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (an IP literal: itself); ``OSError`` when it does not."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class FetchPolicy:
    """How an image URL is fetched: at most ``max_bytes``, within ``timeout_s`` (redirects
    included), at most ``max_redirects`` hops; ``address_allowed`` and ``resolver`` are the
    production checks (tests of the fetch itself replace them)."""

    max_bytes: int
    timeout_s: float
    max_redirects: int = 3
    address_allowed: Callable[[IPAddress], bool] = is_public_address
    resolver: Resolver = resolve_host
    tls: ssl.SSLContext = field(default_factory=ssl.create_default_context)


@dataclass(frozen=True)
class _Target:
    https: bool
    host: str
    port: int
    path: str

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == (443 if self.https else 80) else f"{host}:{self.port}"


async def check_url(url: str, policy: FetchPolicy) -> None:
    """Raises :class:`ImageFetchError` when ``url`` is no ``http(s)`` URL or its host has an address
    the policy refuses (checked again, and connected to, by :func:`fetch_image`)."""
    try:
        async with asyncio.timeout(policy.timeout_s):
            await _checked_addresses(_target(url), policy)
    except TimeoutError:
        raise ImageFetchError(
            f"resolving the image URL's host took longer than {policy.timeout_s:g} s"
        ) from None


async def fetch_image(url: str, policy: FetchPolicy) -> bytes:
    """The body of a ``200`` answer to ``GET url``; raises :class:`ImageFetchError`."""
    try:
        async with asyncio.timeout(policy.timeout_s):
            for _ in range(policy.max_redirects + 1):
                target = _target(url)
                addresses = await _checked_addresses(target, policy)
                status, location, body = await _get(target, addresses, policy)
                if status not in _REDIRECTS:
                    if status != 200:
                        raise ImageFetchError(f"the image URL answered HTTP {status}")
                    return body
                if not location:
                    raise ImageFetchError(f"the image URL answered HTTP {status} without a Location")
                url = urljoin(url, location)
            raise ImageFetchError(f"the image URL redirected more than {policy.max_redirects} times")
    except TimeoutError:
        raise ImageFetchError(f"fetching the image URL took longer than {policy.timeout_s:g} s") from None


def _target(url: str) -> _Target:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ImageFetchError("the image URL is not a valid URL") from None
    if parts.scheme not in ("http", "https"):
        raise ImageFetchError(f"only http and https image URLs are fetched, not {parts.scheme!r}")
    if not parts.hostname:
        raise ImageFetchError("the image URL has no host")
    if parts.username is not None or parts.password is not None:
        raise ImageFetchError("image URLs with credentials (user@host) are not fetched")
    https = parts.scheme == "https"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(https, parts.hostname, port or (443 if https else 80), path)


async def _checked_addresses(target: _Target, policy: FetchPolicy) -> list[str]:
    """Every address of the target's host, each allowed by the policy (else the fetch is refused)."""
    try:
        resolved = await policy.resolver(target.host, target.port)
    except OSError:
        raise ImageFetchError(f"the image URL's host {target.host!r} does not resolve") from None
    if not resolved:
        raise ImageFetchError(f"the image URL's host {target.host!r} does not resolve")
    for text in resolved:
        try:
            allowed = policy.address_allowed(parse_address(text))
        except ValueError:
            allowed = False
        if not allowed:
            raise ImageFetchError(
                f"the image URL's host {target.host!r} is not a public address; "
                "the edge fetches images only from public addresses"
            )
    return resolved


async def _get(target: _Target, addresses: list[str], policy: FetchPolicy) -> tuple[int, str, bytes]:
    """``GET`` on the first of ``addresses`` that accepts a connection: (status, Location, body)."""
    streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    for address in addresses:
        try:
            streams = await asyncio.open_connection(
                address,
                target.port,
                ssl=policy.tls if target.https else None,
                server_hostname=target.host if target.https else None,
            )
            break
        except ssl.SSLError:
            raise ImageFetchError("the image URL's TLS certificate could not be verified") from None
        except OSError:
            continue
    if streams is None:
        raise ImageFetchError(f"could not connect to the image URL's host {target.host!r}")
    reader, writer = streams
    try:
        return await _exchange(reader, writer, target, policy.max_bytes)
    except (h11.RemoteProtocolError, ConnectionError, ssl.SSLError):
        raise ImageFetchError("the image URL's server sent a broken HTTP answer") from None
    finally:
        writer.close()


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: _Target, max_bytes: int
) -> tuple[int, str, bytes]:
    connection = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="GET",
        target=target.path,
        headers=[
            ("Host", target.host_header),
            ("User-Agent", "sluice-edge"),
            ("Accept", "image/png, image/jpeg, image/webp, image/gif"),
            ("Connection", "close"),
        ],
    )
    writer.write(connection.send(request) + connection.send(h11.EndOfMessage()))
    await writer.drain()
    status, location, body = 0, "", bytearray()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            connection.receive_data(await reader.read(_READ_BYTES))
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = {name.decode().lower(): value.decode("latin-1") for name, value in event.headers}
            location = headers.get("location", "")
            length = headers.get("content-length", "")
            if status == 200 and length.isdigit() and int(length) > max_bytes:
                raise ImageFetchError(f"the image is {int(length)} bytes; at most {max_bytes} are accepted")
            if status != 200:
                return status, location, b""
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_bytes:
                raise ImageFetchError(f"the image is over {max_bytes} bytes, the most accepted")
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return status, location, bytes(body)
