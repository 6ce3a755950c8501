"""Image URLs: the address policy (only public unicast addresses), the bounded fetch against a
local HTTP server (with a policy that lets the test's own addresses through), and the edge's image
path end to end against a scripted worker (refusals before any worker call, parts as bytes)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import httpx
import pytest
from edge_fakes import Abort, FakeWorker, content, finished, run, running_edge, running_worker, started, usage

import edge.surfaces.images as edge_images
from edge.image_urls.fetch import FetchPolicy, ImageFetchError, check_url, fetch_image
from edge.image_urls.policy import is_public_address, parse_address
from sluice.status import ErrorDetails
from tests.images import data_url, tiny_png

PNG = tiny_png()

# --- the address policy --------------------------------------------------------------------

NOT_PUBLIC = [
    "127.0.0.1",
    "127.255.255.254",
    "0.0.0.0",
    "0.1.2.3",
    "10.0.0.1",
    "10.255.255.255",
    "172.16.0.1",
    "172.31.255.255",
    "192.168.0.1",
    "169.254.169.254",  # the cloud metadata address
    "169.254.0.1",
    "100.64.0.1",  # carrier-grade NAT
    "100.100.100.200",  # Alibaba Cloud's metadata address
    "192.0.0.9",
    "192.0.2.1",  # documentation
    "198.18.0.1",  # benchmarking
    "198.51.100.7",
    "203.0.113.9",
    "224.0.0.1",  # multicast
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    "::1",
    "::",
    "::ffff:127.0.0.1",  # IPv4-mapped loopback
    "::ffff:10.0.0.1",
    "::ffff:169.254.169.254",
    "::127.0.0.1",  # IPv4-compatible (deprecated)
    "fe80::1",  # link-local
    "fe80::1%eth0",
    "fc00::1",  # unique local
    "fd00:ec2::254",  # AWS's IPv6 metadata address
    "fec0::1",  # site-local (deprecated)
    "ff02::1",  # multicast
    "2001:db8::1",  # documentation
    "2001::1",  # Teredo
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2002:c0a8:101::1",  # 6to4 of 192.168.1.1
    "100::1",  # discard-only
]
PUBLIC = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.215.14",
    "2606:4700:4700::1111",
    "2001:4860:4860::8888",
    "::ffff:8.8.8.8",
    "64:ff9b::808:808",
    "2002:808:808::1",
]


@pytest.mark.parametrize("address", NOT_PUBLIC)
def test_non_public_addresses_are_refused(address: str) -> None:
    assert not is_public_address(parse_address(address))


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_are_allowed(address: str) -> None:
    assert is_public_address(parse_address(address))


@pytest.mark.parametrize(
    ("network", "below", "above"),
    [
        ("10.0.0.0/8", "9.255.255.255", "11.0.0.0"),
        ("127.0.0.0/8", "126.255.255.255", "128.0.0.0"),
        ("169.254.0.0/16", "169.253.255.255", "169.255.0.0"),
        ("172.16.0.0/12", "172.15.255.255", "172.32.0.0"),
        ("192.168.0.0/16", "192.167.255.255", "192.169.0.0"),
        ("100.64.0.0/10", "100.63.255.255", "100.128.0.0"),
    ],
)
def test_a_blocked_network_ends_exactly_at_its_bounds(network: str, below: str, above: str) -> None:
    net = ipaddress.IPv4Network(network)
    assert not is_public_address(net[0]) and not is_public_address(net[-1])
    assert is_public_address(parse_address(below)) and is_public_address(parse_address(above))


# --- the fetch, against a local server -----------------------------------------------------

Handler = Callable[[bytes], Awaitable[bytes | None]]


@contextlib.asynccontextmanager
async def http_server(handler: Handler) -> AsyncIterator[tuple[int, list[bytes]]]:
    """A one-request-per-connection HTTP server on 127.0.0.1: ``handler(request head)`` returns the
    raw answer (None: never answer). Yields the port and the heads received."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        answer = await handler(head)
        if answer is None:
            await asyncio.sleep(30)
        else:
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port, heads
    finally:
        server.close()


def answer(status: str = "200 OK", body: bytes = PNG, headers: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body


def names(mapping: dict[str, list[str]]) -> Callable[[str, int], Awaitable[list[str]]]:
    async def resolve(host: str, port: int) -> list[str]:
        if host not in mapping:
            raise OSError("unknown host")
        return mapping[host]

    return resolve


def lenient(**overrides: Any) -> FetchPolicy:
    """The test's own loopback server counts as allowed; 10.x stays refused."""
    settings: dict[str, Any] = {
        "max_bytes": 1 << 20,
        "timeout_s": 5.0,
        "address_allowed": lambda ip: str(ip) == "127.0.0.1",
        "resolver": names({"images.test": ["127.0.0.1"], "127.0.0.1": ["127.0.0.1"]}),
    }
    return FetchPolicy(**(settings | overrides))


def fails(coro: Awaitable[Any], words: str) -> None:
    async def go() -> None:
        with pytest.raises(ImageFetchError, match=words):
            await coro

    run(go())


def test_fetches_the_body_from_the_checked_address_with_the_url_host() -> None:
    async def go() -> None:
        async def handler(head: bytes) -> bytes:
            return answer()

        async with http_server(handler) as (port, heads):
            assert await fetch_image(f"http://images.test:{port}/a.png?x=1", lenient()) == PNG
        assert heads[0].startswith(b"GET /a.png?x=1 HTTP/1.1")
        assert f"host: images.test:{port}".encode() in heads[0].lower()

    run(go())


def test_a_chunked_body_is_read() -> None:
    async def go() -> None:
        async def handler(head: bytes) -> bytes:
            half = len(PNG) // 2
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (PNG[:half], PNG[half:]))
            return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"

        async with http_server(handler) as (port, _):
            assert await fetch_image(f"http://images.test:{port}/", lenient()) == PNG

    run(go())


@pytest.mark.parametrize(
    ("response", "words"),
    [
        (answer("404 Not Found", b"no"), "HTTP 404"),
        (answer(body=PNG * 40), "at most 1000 are accepted"),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + PNG * 40, "over 1000 bytes"),
        (b"garbage\r\n\r\n", "broken HTTP answer"),
        (answer("302 Found", b"", "Location: /again\r\n"), "redirected more than 3 times"),
        (answer("301 Moved", b""), "without a Location"),
    ],
)
def test_bad_answers_are_errors(response: bytes, words: str) -> None:
    async def go() -> None:
        async def handler(head: bytes) -> bytes:
            return response

        async with http_server(handler) as (port, _):
            with pytest.raises(ImageFetchError, match=words):
                await fetch_image(f"http://images.test:{port}/", lenient(max_bytes=1000))

    run(go())


def test_redirects_are_followed_and_re_checked() -> None:
    async def go() -> None:
        async def handler(head: bytes) -> bytes:
            if head.startswith(b"GET /first "):
                return answer("302 Found", b"", "Location: /second\r\n")
            if head.startswith(b"GET /inside "):
                return answer("307 Temporary Redirect", b"", "Location: http://inside.test/secret\r\n")
            return answer()

        policy = lenient(resolver=names({"images.test": ["127.0.0.1"], "inside.test": ["10.0.0.5"]}))
        async with http_server(handler) as (port, heads):
            assert await fetch_image(f"http://images.test:{port}/first", policy) == PNG
            with pytest.raises(ImageFetchError, match="not a public address"):
                await fetch_image(f"http://images.test:{port}/inside", policy)
        assert len(heads) == 3  # the refused target was never connected to

    run(go())


def test_a_host_with_any_refused_address_is_refused() -> None:
    # A name answering one allowed and one internal address (DNS rebinding's first step) is refused
    # outright, and nothing is connected to.
    async def go() -> None:
        async def handler(head: bytes) -> bytes:
            return answer()

        policy = lenient(resolver=names({"images.test": ["127.0.0.1", "10.0.0.1"]}))
        async with http_server(handler) as (port, heads):
            with pytest.raises(ImageFetchError, match="not a public address"):
                await fetch_image(f"http://images.test:{port}/", policy)
            with pytest.raises(ImageFetchError, match="not a public address"):
                await check_url(f"http://images.test:{port}/", policy)
        assert heads == []

    run(go())


def test_a_silent_server_runs_into_the_timeout() -> None:
    async def go() -> None:
        async def handler(head: bytes) -> None:
            return None

        async with http_server(handler) as (port, _):
            with pytest.raises(ImageFetchError, match=r"took longer than 0\.2 s"):
                await fetch_image(f"http://images.test:{port}/", lenient(timeout_s=0.2))

    run(go())


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1/a.png", "not a public address"),
        ("http://localhost/a.png", "not a public address"),
        ("http://[::1]/a.png", "not a public address"),
        ("http://[::ffff:127.0.0.1]/a.png", "not a public address"),
        ("http://169.254.169.254/latest/meta-data/", "not a public address"),
        ("http://0.0.0.0:8080/", "not a public address"),
        ("http://2130706433/", "not a public address"),  # 127.0.0.1 as one number
        ("http://user:secret@example.com/a.png", "credentials"),
        ("ftp://example.com/a.png", "only http and https"),
        ("http:///a.png", "no host"),
        ("http://example.com:99999/", "not a valid URL"),
        ("http://no-such-host.invalid/a.png", "does not resolve"),
    ],
)
def test_the_production_policy_refuses_internal_and_malformed_urls(url: str, words: str) -> None:
    fails(check_url(url, FetchPolicy(max_bytes=1 << 20, timeout_s=5.0)), words)


def test_the_production_policy_never_connects_to_loopback() -> None:
    async def go() -> None:
        async def handler(head: bytes) -> bytes:
            return answer()

        async with http_server(handler) as (port, heads):
            with pytest.raises(ImageFetchError, match="not a public address"):
                await fetch_image(
                    f"http://127.0.0.1:{port}/a.png", FetchPolicy(max_bytes=1 << 20, timeout_s=5.0)
                )
        assert heads == []

    run(go())


# --- through the edge, against a scripted worker -------------------------------------------

SCRIPT = [started(), content("seen"), finished(), usage()]


def chat_body(*parts: Any) -> dict[str, Any]:
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, *parts]}],
    }


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "high"}}


async def post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        return await client.post(path, json=body)


def test_images_reach_a_vision_worker_as_bytes_in_order() -> None:
    async def go() -> None:
        fake = FakeWorker(script=SCRIPT, accepts_images=True)
        async with running_worker(fake) as address, running_edge([address]) as base:
            reply = await post(base, "/v1/chat/completions", chat_body(image(data_url(PNG))))
            assert reply.status_code == 200, reply.text
            async with httpx.AsyncClient() as client:
                (listed,) = (await client.get(f"{base}/v1/models")).json()["data"]
        assert listed["accepts_images"] is True
        (message,) = fake.requests[0].chat.messages
        assert [p.WhichOneof("part") for p in message.parts] == ["text", "image"]
        assert message.parts[1].image.data == PNG and message.parts[1].image.detail == "high"

    run(go())


def test_a_model_without_images_is_refused_before_the_worker_is_called() -> None:
    async def go() -> None:
        fake = FakeWorker(script=SCRIPT)
        async with running_worker(fake) as address, running_edge([address]) as base:
            reply = await post(base, "/v1/chat/completions", chat_body(image(data_url(PNG))))
            assert reply.status_code == 400
            error = reply.json()["error"]
            assert (error["param"], error["code"]) == ("messages[0].content[1]", "image_not_supported")
            # Also true of a vision-language model served for text alone (Gemma 4, Qwen3.5).
            assert "or one whose images are not served yet" in error["message"]
            async with httpx.AsyncClient() as client:
                (listed,) = (await client.get(f"{base}/v1/models")).json()["data"]
            assert "accepts_images" not in listed
            anthropic = await post(
                base,
                "/v1/messages",
                {
                    "model": "SmolLM2-135M-Instruct",
                    "max_tokens": 4,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "image",
                                    "source": {
                                        "type": "base64",
                                        "media_type": "image/png",
                                        "data": "iVBORw0KGgo=",
                                    },
                                }
                            ],
                        }
                    ],
                },
            )
            assert anthropic.status_code == 400
            assert anthropic.json()["error"]["type"] == "invalid_request_error"
            assert "messages[0].content[0]" in anthropic.json()["error"]["message"]
        assert fake.calls_started == 0

    run(go())


def test_the_workers_refusal_of_parts_is_a_400() -> None:
    async def go() -> None:
        refusal = ErrorDetails(
            grpc.StatusCode.INVALID_ARGUMENT,
            "this model takes no images",
            "invalid_value",
            "messages[0].parts",
        )
        fake = FakeWorker(script=[Abort(refusal)], accepts_images=True)
        async with running_worker(fake) as address, running_edge([address]) as base:
            reply = await post(base, "/v1/chat/completions", chat_body(image(data_url(PNG))))
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "messages[0].parts"

    run(go())


def test_image_urls_are_refused_when_off_and_for_loopback_when_on() -> None:
    async def go() -> None:
        async def handler(head: bytes) -> bytes:
            return answer()

        fake = FakeWorker(script=SCRIPT, accepts_images=True)
        async with http_server(handler) as (port, heads), running_worker(fake) as address:
            url = f"http://127.0.0.1:{port}/a.png"
            async with running_edge([address]) as base:
                off = await post(base, "/v1/chat/completions", chat_body(image(url)))
            async with running_edge([address], allow_image_urls=True) as base:
                loopback = await post(base, "/v1/chat/completions", chat_body(image(url)))
                responses = await post(
                    base,
                    "/v1/responses",
                    {
                        "model": "SmolLM2-135M-Instruct",
                        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}],
                    },
                )
        assert off.status_code == 400 and "--allow-image-urls" in off.json()["error"]["message"]
        assert loopback.status_code == 400 and loopback.json()["error"]["param"] == "messages[0].content[1]"
        assert "not a public address" in loopback.json()["error"]["message"]
        assert responses.status_code == 400 and responses.json()["error"]["param"] == "input[0].content[0]"
        assert heads == [] and fake.calls_started == 0

    run(go())


def test_a_fetched_image_travels_as_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The edge runs in this process: its fetch policy is swapped for one that lets the test's own
    # loopback server through (the production policy never would).
    monkeypatch.setattr(edge_images, "_policy_for", lambda max_bytes, timeout_s: lenient(max_bytes=max_bytes))

    async def go() -> None:
        async def handler(head: bytes) -> bytes:
            return answer()

        fake = FakeWorker(script=SCRIPT, accepts_images=True)
        async with (
            http_server(handler) as (port, _),
            running_worker(fake) as address,
            running_edge([address], allow_image_urls=True, max_image_bytes=len(PNG)) as base,
        ):
            reply = await post(base, "/v1/chat/completions", chat_body(image(f"http://images.test:{port}/")))
            assert reply.status_code == 200, reply.text
            too_big = await post(
                base, "/v1/chat/completions", chat_body(image(data_url(PNG + b"x")), image(data_url(PNG)))
            )
        assert fake.requests[0].chat.messages[0].parts[1].image.data == PNG
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "messages[0].content[1]"

    run(go())
