"""Images on every surface, at parse time: parts in order as the worker's ``parts``, text-only
messages unchanged, and every bad image a 400 naming its part in the surface's own terms."""

from __future__ import annotations

from typing import Any

import pytest

from edge.errors import InvalidRequestError
from edge.requests.limits import RequestLimits
from edge.surfaces.anthropic.request import parse_messages_request
from edge.surfaces.native.request import parse_native_request
from edge.surfaces.responses.request import parse_responses_request
from edge.surfaces.shared.chat_request import ChatCompletionRequest, parse_chat_request
from edge.surfaces.shared.images import decode_base64_image, decode_data_url
from edge.surfaces.shared.worker_request import to_generate_request
from sluice.v1 import worker_pb2
from tests.images import GIF_HEAD, JPEG_HEAD, WEBP_HEAD, b64, data_url, tiny_png

PNG = tiny_png()
PNG_URL = data_url(PNG)


def chat_with(*parts: Any, role: str = "user", **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": role, "content": list(parts)}], **fields}


def image(url: str, detail: str | None = None) -> dict[str, Any]:
    image_url = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": image_url}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def worker_messages(chat: ChatCompletionRequest) -> list[worker_pb2.ChatMessage]:
    return list(to_generate_request(chat, "req").chat.messages)


def refused(parse: Any, body: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        parse(body)
    assert caught.value.http_status == 400
    return caught.value


# --- data URLs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "media_type"),
    [(PNG, "image/png"), (JPEG_HEAD, "image/jpeg"), (WEBP_HEAD, "image/webp"), (GIF_HEAD, "image/gif")],
)
def test_each_supported_format_is_read_from_its_bytes(data: bytes, media_type: str) -> None:
    decoded = decode_data_url(data_url(data, media_type), 1 << 20)
    assert (decoded.data, decoded.mime_type) == (data, media_type)
    # The bytes decide, not the declared type (nor its absence).
    assert decode_data_url(f"data:;base64,{b64(data)}", 1 << 20).mime_type == media_type


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png," + b64(PNG), "base64"),
        ("data:image/png;base64,not base64!", "does not decode"),
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not an image"),
        ("data:text/plain;base64," + b64(PNG), "'text/plain' is not supported"),
        ("data:image/bmp;base64," + b64(b"BM" + bytes(20)), "'image/bmp' is not supported"),
        ("data:image/png;base64,", "empty"),
        ("https://example.com/cat.png", "not fetched"),
        ("file:///etc/passwd", "must be a data URL"),
    ],
)
def test_bad_data_urls_say_what_is_wrong(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        decode_data_url(url, 1 << 20)


def test_base64_with_line_breaks_and_the_url_safe_alphabet_decodes() -> None:
    data = PNG + b"\xfb\xff"  # bytes whose standard base64 holds '+' or '/'
    encoded = b64(data)
    wrapped = "\n".join(encoded[i : i + 20] for i in range(0, len(encoded), 20))
    assert decode_base64_image(wrapped, 1 << 20).data == data
    assert decode_base64_image(encoded.replace("+", "-").replace("/", "_").rstrip("="), 1 << 20).data == data


def test_an_image_over_the_size_limit_is_refused_before_decoding() -> None:
    with pytest.raises(ValueError, match=r"at most 100 are accepted|over 100 bytes"):
        decode_data_url(data_url(PNG + bytes(200)), 100)


# --- chat ----------------------------------------------------------------------------------


def test_chat_parts_reach_the_worker_in_order_with_detail() -> None:
    chat = parse_chat_request(chat_with(text("one"), image(PNG_URL, "low"), text("two"), image(PNG_URL)))
    (message,) = worker_messages(chat)
    assert not message.HasField("content")
    assert [p.WhichOneof("part") for p in message.parts] == ["text", "image", "text", "image"]
    assert [p.text for p in message.parts if p.HasField("text")] == ["one", "two"]
    first = message.parts[1].image
    assert (first.data, first.mime_type, first.detail) == (PNG, "image/png", "low")
    assert message.parts[3].image.detail == ""


def test_text_only_messages_keep_using_content() -> None:
    chat = parse_chat_request(chat_with(text("one"), text("two")))
    (message,) = worker_messages(chat)
    assert message.content == "one\ntwo" and not message.parts


def test_a_bare_url_string_is_taken_as_image_url() -> None:
    body = chat_with({"type": "image_url", "image_url": PNG_URL})
    assert worker_messages(parse_chat_request(body))[0].parts[0].image.data == PNG


def test_image_text_does_not_count_toward_the_prompt_characters() -> None:
    limits = RequestLimits(max_prompt_chars=10)
    parse_chat_request(chat_with(text("short"), image(PNG_URL)), limits)


@pytest.mark.parametrize(
    ("part", "param", "words"),
    [
        (image("data:image/png;base64,!!!!"), "messages[0].content[1]", "does not decode"),
        (image("data:image/svg+xml;base64," + b64(b"<svg/>")), "messages[0].content[1]", "not supported"),
        (image("data:image/png," + b64(PNG)), "messages[0].content[1]", "base64"),
        (image("http://example.com/a.png"), "messages[0].content[1]", "--allow-image-urls"),
        (image(PNG_URL, "huge"), "messages[0].content[1].image_url.detail", ""),
        ({"type": "image_url"}, "messages[0].content[1].image_url", ""),
        ({"type": "input_audio", "input_audio": {}}, "messages[0].content", "'input_audio' is not supported"),
    ],
)
def test_chat_image_errors_name_the_part(part: dict[str, Any], param: str, words: str) -> None:
    error = refused(parse_chat_request, chat_with(text("look"), part))
    assert error.param == param
    assert words in error.message


def test_chat_image_limits_name_the_part_over_them() -> None:
    limits = RequestLimits(max_images=2, max_image_bytes=len(PNG))
    body = chat_with(image(PNG_URL), image(PNG_URL), image(PNG_URL))
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat_request(body, limits)
    assert caught.value.param == "messages[0].content[2]" and "at most 2 images" in caught.value.message
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat_request(chat_with(image(data_url(PNG + b"x"))), limits)
    assert caught.value.param == "messages[0].content[0]"


def test_allowed_image_urls_are_left_for_the_fetch() -> None:
    limits = RequestLimits(allow_image_urls=True)
    chat = parse_chat_request(chat_with(image("https://example.com/a.png"), image(PNG_URL)), limits)
    (url_part, inline_part) = [part for _, part in chat.image_parts()]
    assert url_part.image is None and inline_part.image is not None


# --- Anthropic Messages --------------------------------------------------------------------


def anthropic_with(*blocks: Any, system: str | None = "be brief") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": list(blocks)}],
    }
    if system is not None:
        body["system"] = system
    return body


def base64_block(media_type: str, data: str) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def test_anthropic_image_blocks_become_parts_in_order() -> None:
    body = anthropic_with(
        {"type": "text", "text": "compare"},
        base64_block("image/png", b64(PNG)),
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": b64(JPEG_HEAD)}},
    )
    system, user = worker_messages(parse_messages_request(body).chat)
    assert system.content == "be brief"
    assert [p.WhichOneof("part") for p in user.parts] == ["text", "image", "image"]
    assert [p.image.mime_type for p in user.parts[1:]] == ["image/png", "image/jpeg"]


@pytest.mark.parametrize(
    ("block", "param"),
    [
        (base64_block("image/png", "%%%"), "messages[0].content[1]"),
        (base64_block("application/pdf", b64(PNG)), "messages[0].content[1]"),
        (base64_block("image/png", b64(b"plain text")), "messages[0].content[1]"),
        (
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}},
            "messages[0].content[1]",
        ),
        ({"type": "image", "source": {"type": "file", "file_id": "f"}}, "messages[0].content[1].source.type"),
        (
            {"type": "image", "source": {"type": "base64", "data": b64(PNG)}},
            "messages[0].content[1].source.media_type",
        ),
        ({"type": "image", "source": {"type": "url"}}, "messages[0].content[1].source.url"),
    ],
)
def test_anthropic_image_errors_name_the_block(block: dict[str, Any], param: str) -> None:
    # The system prompt shifts the chat messages by one: the error still names the caller's block.
    error = refused(parse_messages_request, anthropic_with({"type": "text", "text": "look"}, block))
    assert error.param == param
    assert f"'{param}'" in error.message


@pytest.mark.parametrize("system", [None, "be brief"])
def test_anthropic_errors_name_the_block_where_chat_and_surface_paths_agree(system: str | None) -> None:
    body = anthropic_with({"type": "text", "text": "x"}, base64_block("image/png", "%%%"), system=system)
    assert refused(parse_messages_request, body).param == "messages[0].content[1]"


def test_anthropic_url_sources_are_kept_for_the_fetch_when_allowed() -> None:
    from edge.requests.limits import request_limits

    token = request_limits.set(RequestLimits(allow_image_urls=True))
    try:
        parsed = parse_messages_request(
            anthropic_with({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}})
        )
    finally:
        request_limits.reset(token)
    ((param, part),) = list(parsed.chat.image_parts())
    assert part.image is None and parsed.chat.surface_param(param) == "messages[0].content[0]"


# --- Responses -----------------------------------------------------------------------------


def responses_with(*parts: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "instructions": "be brief",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "look"}, *parts]}],
    }


def test_responses_input_image_becomes_a_part_with_its_detail() -> None:
    parsed = parse_responses_request(
        responses_with({"type": "input_image", "image_url": PNG_URL, "detail": "high"})
    )
    _, user = worker_messages(parsed.chat)
    assert [p.WhichOneof("part") for p in user.parts] == ["text", "image"]
    assert (user.parts[1].image.data, user.parts[1].image.detail) == (PNG, "high")


@pytest.mark.parametrize(
    ("part", "param", "code"),
    [
        (
            {"type": "input_image", "file_id": "file-1"},
            "input[0].content[1].file_id",
            "unsupported_parameter",
        ),
        ({"type": "input_image"}, "input[0].content[1].image_url", "missing_required_parameter"),
        (
            {"type": "input_image", "image_url": "data:image/png;base64,***"},
            "input[0].content[1]",
            "invalid_value",
        ),
        (
            {"type": "input_image", "image_url": "http://10.0.0.1/a.png"},
            "input[0].content[1]",
            "invalid_value",
        ),
        ({"type": "input_file", "file_id": "f"}, "input[0].content[1].type", "unsupported_parameter"),
    ],
)
def test_responses_image_errors_name_the_part(part: dict[str, Any], param: str, code: str) -> None:
    error = refused(parse_responses_request, responses_with(part))
    assert (error.param, error.code) == (param, code)


# --- native --------------------------------------------------------------------------------


def test_native_messages_take_chat_parts() -> None:
    body = {
        "model": "m",
        "system_prompt": "be brief",
        "input": [{"role": "user", "content": [text("look"), image(PNG_URL, "auto")]}],
    }
    _, user = worker_messages(parse_native_request(body).chat)
    assert [p.WhichOneof("part") for p in user.parts] == ["text", "image"]
    assert user.parts[1].image.detail == "auto"


def test_native_image_errors_name_the_part() -> None:
    body = {"model": "m", "system_prompt": "x", "input": [{"role": "user", "content": [image("data:,x")]}]}
    error = refused(parse_native_request, body)
    assert error.param == "input[0].content[0]"
