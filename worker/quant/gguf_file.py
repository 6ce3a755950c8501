"""A GGUF file's tensor directory, read without parsing its metadata values into Python objects.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Metadata value types with a fixed size: type id -> bytes.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    """One tensor: ``shape`` in GGUF order (innermost first, as ``ReaderTensor.shape``); ``data`` as
    ``GGUFReader`` gives it (float32/float16 values, or uint8 rows of blocks for quantized types)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray


@dataclass
class GGUFFile:
    architecture: str | None
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buffer: memoryview):
        self.buffer, self.at = buffer, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        text = bytes(self.buffer[self.at : self.at + length]).decode("utf-8", errors="replace")
        self.at += length
        return text

    def skip_value(self, kind: int) -> None:
        if kind in _FIXED:
            self.at += _FIXED[kind]
        elif kind == _STRING:
            (length,) = self.unpack("<Q")
            self.at += length
        elif kind == _ARRAY:
            element, count = self.unpack("<IQ")
            if element in _FIXED:
                self.at += _FIXED[element] * count
            else:
                for _ in range(count):
                    self.skip_value(element)
        else:
            raise ValueError(f"unknown GGUF metadata type {kind}")


def read_gguf(path: Path) -> GGUFFile:
    """The architecture and tensor directory of a GGUF file; the tensor data stays memory-mapped."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped.data))
    magic, version = cursor.unpack("<4sI")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path.name} is not a GGUF v2/v3 file")
    tensor_count, kv_count = cursor.unpack("<QQ")
    architecture, alignment = None, 32
    for _ in range(kv_count):
        key = cursor.string()
        (kind,) = cursor.unpack("<I")
        if key == "general.architecture" and kind == _STRING:
            architecture = cursor.string()
        elif key == "general.alignment" and kind == 4:
            (alignment,) = cursor.unpack("<I")
        else:
            cursor.skip_value(kind)
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        (dims,) = cursor.unpack("<I")
        shape = cursor.unpack(f"<{dims}Q")
        kind, offset = cursor.unpack("<IQ")
        infos.append((name, tuple(int(d) for d in shape), GGMLQuantizationType(kind), int(offset)))
    start = -(-cursor.at // alignment) * alignment
    tensors = [
        GGUFTensor(name, shape, kind, _data(mapped, start + offset, shape, kind))
        for name, shape, kind, offset in infos
    ]
    return GGUFFile(architecture, tensors)


def _data(mapped: np.ndarray, at: int, shape: tuple[int, ...], kind: GGMLQuantizationType) -> np.ndarray:
    elements = int(np.prod(shape))
    rows = elements // shape[0]
    if kind == GGMLQuantizationType.F32:
        return mapped[at : at + 4 * elements].view(np.float32).reshape(tuple(reversed(shape)))
    if kind == GGMLQuantizationType.F16:
        return mapped[at : at + 2 * elements].view(np.float16).reshape(tuple(reversed(shape)))
    block, size = GGML_QUANT_SIZES[kind]
    row_bytes = shape[0] // block * size
    return mapped[at : at + rows * row_bytes].reshape(rows, row_bytes)
