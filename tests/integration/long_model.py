"""A tiny random Llama with a long context, for streams that must outlast a test's timers.

Like the ``tiny_model_dir`` fixture of tests/conftest.py (same tokenizer and
chat template), but with 4096 positions instead of 512: generating to the end
of its context (``ignore_eos``) takes several seconds even on a fast machine,
so a test can keep a stream (or a worker slot) busy for as long as it likes
and end it by disconnecting.
"""

from __future__ import annotations

from pathlib import Path

import pytest

POSITIONS = 4096


def build_long_tiny_model(folder: Path, tokenizer_dir: Path) -> Path:
    """Saves the model and tokenizer into ``folder`` with ``save_pretrained``; returns ``folder``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return build_long_tiny_model(tmp_path_factory.mktemp("tiny-llama-4k"), default_model_dir)
