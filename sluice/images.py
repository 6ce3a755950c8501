"""Images in chat messages: the formats Sluice takes (read from the file's first bytes) and the
typed parts (``ContentPart``) a caller builds a message from. Notes: docs/shared.md."""

from __future__ import annotations

from collections.abc import Iterable

from sluice.v1 import worker_pb2

#: The image formats a message may carry (GIF: its first frame), by media type.
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
#: The OpenAI ``detail`` hints; "" leaves it to the worker ("auto").
DETAILS = ("", "auto", "low", "high")


def sniff_image_type(data: bytes) -> str | None:
    """The media type of an encoded image from its magic bytes (one of :data:`IMAGE_TYPES`),
    or ``None`` when ``data`` is none of them."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    return None


def text_part(text: str) -> worker_pb2.ContentPart:
    """A text piece of a message's ``parts``."""
    return worker_pb2.ContentPart(text=text)


def image_part(data: bytes, *, mime_type: str = "", detail: str = "") -> worker_pb2.ContentPart:
    """An image piece of a message's ``parts``: the encoded file's bytes (PNG, JPEG, WebP, GIF).

    ``mime_type`` defaults to the type read from the bytes; ``detail`` is OpenAI's hint
    ("auto", "low", "high"). Raises ``ValueError`` for bytes that are no supported image, a
    ``mime_type`` that disagrees with them, or an unknown ``detail``.
    """
    sniffed = sniff_image_type(data)
    if sniffed is None:
        raise ValueError(f"not a PNG, JPEG, WebP or GIF image (starts with {data[:8]!r})")
    if mime_type and mime_type != sniffed:
        raise ValueError(f"mime_type {mime_type!r} does not match the bytes, which are {sniffed}")
    if detail not in DETAILS:
        raise ValueError(f"detail must be one of 'auto', 'low', 'high', got {detail!r}")
    return worker_pb2.ContentPart(image=worker_pb2.ImageInput(data=data, mime_type=sniffed, detail=detail))


def user_message(parts: Iterable[str | bytes | worker_pb2.ContentPart]) -> worker_pb2.ChatMessage:
    """A user message from pieces in order: a ``str`` is text, ``bytes`` an encoded image
    (:func:`image_part`), a ``ContentPart`` is taken as it is."""
    built = [
        text_part(p) if isinstance(p, str) else image_part(p) if isinstance(p, bytes) else p for p in parts
    ]
    return worker_pb2.ChatMessage(role="user", parts=built)
