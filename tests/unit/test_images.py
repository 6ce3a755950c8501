"""sluice.images: the formats read from the bytes, and the parts an internal caller builds."""

from __future__ import annotations

import pytest

from sluice.images import image_part, sniff_image_type, text_part, user_message
from tests.images import GIF_HEAD, JPEG_HEAD, WEBP_HEAD, tiny_png

PNG = tiny_png()


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (PNG, "image/png"),
        (JPEG_HEAD, "image/jpeg"),
        (WEBP_HEAD, "image/webp"),
        (GIF_HEAD, "image/gif"),
        (b"GIF87a....", "image/gif"),
        (b"BM\x00\x00", None),
        (b"RIFF\x00\x00\x00\x00WAVE", None),
        (b"<svg xmlns=...>", None),
        (b"", None),
    ],
)
def test_sniff_image_type(data: bytes, kind: str | None) -> None:
    assert sniff_image_type(data) == kind


def test_a_user_message_from_text_and_bytes_keeps_the_order() -> None:
    message = user_message(["Compare", PNG, "with", image_part(GIF_HEAD, detail="low")])
    assert message.role == "user" and not message.HasField("content")
    assert [p.WhichOneof("part") for p in message.parts] == ["text", "image", "text", "image"]
    assert (message.parts[1].image.data, message.parts[1].image.mime_type) == (PNG, "image/png")
    assert (message.parts[3].image.mime_type, message.parts[3].image.detail) == ("image/gif", "low")
    assert text_part("x").text == "x"


@pytest.mark.parametrize(
    ("data", "options", "words"),
    [
        (b"not an image", {}, "not a PNG"),
        (PNG, {"mime_type": "image/jpeg"}, "does not match"),
        (PNG, {"detail": "ultra"}, "detail"),
    ],
)
def test_image_part_refuses_what_the_worker_would(data: bytes, options: dict[str, str], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        image_part(data, **options)
