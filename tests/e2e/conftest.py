"""Fixtures shared by the end-to-end modules (each module still starts its own processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    """The default model's own tokenizer, to build token-id prompts and logit_bias keys."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)
