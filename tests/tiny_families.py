"""Tiny random-weight models of the open-model families, from transformers' config classes (no
downloads), each with an eager reference built from its own copy of the config."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

# Small enough for the CPU and triton's interpreter; weights large enough (initializer_range) that
# attention is far from uniform, so a wrong window, softcap or sink changes the logits.
COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
}
WINDOW = 8  # tokens; the tests' prompts are 40+ tokens
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
ALTERNATING = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
SLIDING, GLOBAL = "sliding_attention", "full_attention"

# family -> (config class, what differs from COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),  # qk-norm
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral_window": ("MistralConfig", {"sliding_window": WINDOW}),  # every layer windowed (v0.1)
    "mixtral": ("MixtralConfig", {**MOE, "sliding_window": None}),
    "ministral": ("MinistralConfig", ALTERNATING),  # interleaved local/global
    "gemma2": ("Gemma2Config", {**ALTERNATING, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 16}),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 3,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16,
        },
    ),
    # Gemma 4 (E2B/E4B-like): global layers with a wider head than the sliding ones, the last two
    # layers reading the KV of the last earlier layer of their kind, per-layer embeddings.
    "gemma4_text": (
        "Gemma4TextConfig",
        {
            "num_hidden_layers": 5,
            "layer_types": [SLIDING, GLOBAL, SLIDING, SLIDING, GLOBAL],
            "sliding_window": WINDOW,
            "global_head_dim": 32,
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": COMMON["vocab_size"],
            "final_logit_softcapping": 5.0,
        },
    ),
    # Gemma 4 (26B-like): global layers with their own kv heads, values from the key projection, MoE.
    "gemma4_text_k_eq_v": (
        "Gemma4TextConfig",
        {
            "num_hidden_layers": 3,
            "layer_types": [SLIDING, SLIDING, GLOBAL],
            "sliding_window": WINDOW,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "hidden_size_per_layer_input": 0,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
        },
    ),
    "gpt_oss": ("GptOssConfig", {**MOE, **ALTERNATING}),  # sinks, alternating windows, MoE
    # A window above the context (Phi-4-mini's 262144) is no window; partial rotary.
    "phi3": ("Phi3Config", {"sliding_window": 4096, "partial_rotary_factor": 0.5, "pad_token_id": 0}),
    "granite": (
        "GraniteConfig",
        {
            "attention_multiplier": 0.2,
            "embedding_multiplier": 4.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 2.0,
        },
    ),
    "granitemoe": (
        "GraniteMoeConfig",
        {**MOE, "attention_multiplier": 0.2, "embedding_multiplier": 4.0, "logits_scaling": 2.0},
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "use_qk_norm": True,
            "partial_rotary_factor": 0.5,
        },
    ),
}


# Hybrid families (recurrent mixers beside attention layers: worker/model/recurrent.py): four layers
# mixing both kinds, conv kernel 4, Mamba chunks of 8 tokens so chunked prefill crosses them.
_DELTANET = {
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_QWEN_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
HYBRID_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_5_text": ("Qwen3_5TextConfig", _DELTANET),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        {**_DELTANET, **_QWEN_MOE, "shared_expert_intermediate_size": 32},
    ),
    "qwen3_next": ("Qwen3NextConfig", {**_DELTANET, **_QWEN_MOE, "shared_expert_intermediate_size": 32}),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {
            **MOE,
            "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "mamba"],
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_chunk_size": 8,
        },
    ),
    "nemotron_h": (
        "NemotronHConfig",
        {
            "layers_block_type": ["mamba", "attention", "mlp", "mamba"],
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "n_groups": 1,
            "chunk_size": 8,
        },
    ),
    # Every layer runs attention and a Mamba-2 mixer side by side.
    "falcon_h1": (
        "FalconH1Config",
        {
            "num_hidden_layers": 3,
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_chunk_size": 8,
        },
    ),
    "lfm2": (
        "Lfm2Config",
        {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"]},
    ),
}


def tiny_config(family: str, **changes: Any) -> PretrainedConfig:
    """The tiny config of ``family`` (a key of :data:`FAMILIES` or :data:`HYBRID_FAMILIES`), with
    ``changes``."""
    class_name, overrides = FAMILIES[family] if family in FAMILIES else HYBRID_FAMILIES[family]
    config_class = getattr(transformers, class_name)
    config: PretrainedConfig = config_class(**{**COMMON, **overrides, **changes})
    return config


def tiny_model(config: PretrainedConfig, seed: int = 0) -> Any:
    """A random-weight causal LM of ``config`` in float32, eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):  # gpt-oss: sinks large enough to take a real share
                parameter.copy_(torch.randn_like(parameter) * 2.0)
    return model


def eager_reference(model: Any) -> Any:
    """The same weights in a model with eager attention, built from its own copy of the config
    (sharing the config object would switch the reference to the runner's attention too)."""
    config = copy.deepcopy(model.config)
    config._attn_implementation = "eager"
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    reference.load_state_dict(model.state_dict())
    return reference.eval()


def save_tiny(folder: Path, family: str, tokenizer_dir: Path, **changes: Any) -> Path:
    """Saves ``family``'s tiny random model (with ``changes``, 512 positions) and the tokenizer and
    chat template of ``tokenizer_dir`` into ``folder``, loadable like any checkpoint."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_config(
        family,
        **{"max_position_embeddings": 512, **changes},
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = tiny_model(config)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
