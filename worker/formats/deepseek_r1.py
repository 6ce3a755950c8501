# ruff: noqa: RUF001 (DeepSeek's markers have full-width bars)
"""DeepSeek-R1's thinking: a ``<think>`` block that the prompt often opens itself, so the answer may
start inside it."""

from __future__ import annotations

from collections.abc import Container

from worker.formats.think import think_format, thinks


def _shown(model_type: str, template: str, vocab: Container[str]) -> bool:
    deepseek = model_type.startswith("deepseek") or "｜Assistant｜" in template
    return deepseek and thinks(template, vocab)


REASONING_FORMAT = think_format("deepseek_r1", _shown, rank=3)
