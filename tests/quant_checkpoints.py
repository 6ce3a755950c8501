"""The quantized checkpoints tools/quant_fixtures.py makes with the real tools (``make fixtures``),
by name, for the tests that serve them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.quant_fixtures import ROOT


def quant_checkpoint(name: str) -> Path:
    """The folder of fixture ``name``; the test skips, saying how to make it, where it is missing."""
    folder = ROOT / name
    if not (folder / "reference.json").is_file():
        pytest.skip(f"{folder} is missing: `make fixtures` makes it (tools/quant_fixtures.py)")
    return folder
