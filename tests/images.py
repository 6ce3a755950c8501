"""Small images for tests, built in code: a real PNG (decodable by any image library) and the
magic-byte openings of the other formats the edge takes."""

from __future__ import annotations

import base64
import struct
import zlib

# Openings the edge's format check recognises (enough for the edge; not decodable images).
JPEG_HEAD = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00"
WEBP_HEAD = b"RIFF\x24\x00\x00\x00WEBPVP8 "
GIF_HEAD = b"GIF89a\x01\x00\x01\x00"


def tiny_png(width: int = 4, height: int = 4, rgb: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A valid ``width`` x ``height`` RGB PNG of one colour."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def data_url(data: bytes, media_type: str = "image/png") -> str:
    """``data:<media_type>;base64,<data>``."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
