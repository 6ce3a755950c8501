"""An image part's URL read at parse time: a ``data:`` URL decoded and its bytes checked (PNG, JPEG,
WebP or GIF, read from the magic bytes), an ``http(s)`` URL kept for the fetch before the worker call
(:mod:`edge.surfaces.images`). Errors are ``ValueError`` with a message for the caller."""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from sluice.images import IMAGE_TYPES, sniff_image_type

_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)
_BASE64 = re.compile(rb"[A-Za-z0-9+/]*={0,2}")
_SHOWN = ", ".join(IMAGE_TYPES)


@dataclass(frozen=True)
class Image:
    """An image's encoded bytes and their media type (read from the bytes)."""

    data: bytes
    mime_type: str


def is_remote(url: str) -> bool:
    """Whether ``url`` is one the edge would have to fetch (``http://`` or ``https://``)."""
    return url[:8].lower().startswith(("http://", "https://"))


def decode_data_url(url: str, max_bytes: int) -> Image:
    """The image in ``data:image/<type>;base64,<data>``; raises ``ValueError`` naming what is wrong."""
    match = _DATA_URL.match(url)
    if match is None:
        if is_remote(url):
            raise ValueError("http(s) image URLs are not fetched by this server (see --allow-image-urls)")
        raise ValueError("must be a data URL (data:image/png;base64,...) or an http(s) URL")
    declared = match.group(1).strip().lower()
    if "base64" not in (p.strip().lower() for p in match.group(2).split(";")):
        raise ValueError("the data URL must be base64-encoded (data:<media type>;base64,<data>)")
    if declared and declared not in IMAGE_TYPES:
        raise ValueError(f"media type {declared!r} is not supported; images must be {_SHOWN}")
    return decode_base64_image(url[match.end() :], max_bytes)


def decode_base64_image(text: str, max_bytes: int) -> Image:
    """Base64 text → a checked :class:`Image`; raises ``ValueError`` for text that does not decode,
    an image over ``max_bytes`` or bytes that are not a supported image."""
    raw = text.encode("ascii", "replace")
    raw = raw.translate(None, b" \t\r\n")
    if len(raw) * 3 // 4 > max_bytes + 2:
        raise ValueError(f"the image is over {max_bytes} bytes, the most accepted per image")
    raw = raw.replace(b"-", b"+").replace(b"_", b"/")  # the URL-safe alphabet, too
    if not _BASE64.fullmatch(raw):
        raise ValueError("the base64 data does not decode (a character outside the base64 alphabet)")
    try:
        data = base64.b64decode(raw + b"=" * (-len(raw) % 4), validate=True)
    except binascii.Error:
        raise ValueError("the base64 data does not decode") from None
    return checked_image(data, max_bytes)


def checked_image(data: bytes, max_bytes: int) -> Image:
    """``data`` as an :class:`Image` when it is a supported image of at most ``max_bytes``."""
    if len(data) > max_bytes:
        raise ValueError(f"the image is {len(data)} bytes; at most {max_bytes} are accepted per image")
    if not data:
        raise ValueError("the image is empty")
    mime_type = sniff_image_type(data)
    if mime_type is None:
        raise ValueError(f"the bytes are not an image of a supported type ({_SHOWN})")
    return Image(data, mime_type)
