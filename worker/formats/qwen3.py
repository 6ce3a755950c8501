"""Qwen3's thinking, a ``<think>``…``</think>`` block before the answer: what a model with the marker in
its template or vocabulary is taken to write when no other format claims it."""

from __future__ import annotations

from worker.formats.think import think_format, thinks

REASONING_FORMAT = think_format("qwen3", lambda model_type, template, vocab: thinks(template, vocab), rank=4)
