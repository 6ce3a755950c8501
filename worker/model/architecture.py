"""What a model's attention asks of the paged KV cache, read from its config at load: the
features served (per-layer windows, softcapping, sinks) and the architectures refused, in one line.

Design notes: docs/worker.md; the families: docs/models.md.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from transformers import AutoConfig

from worker.attention.kv_pool import kv_sources, layer_configs
from worker.model.loader import ModelLoadError

log = logging.getLogger(__name__)

# Layer kinds that are softmax attention over the model's own keys and values.
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "attention"})
# Hybrid model types served with the state pool (worker/model/recurrent.py), and the layer kinds
# their configs list besides attention (Nemotron-H's MLP-only and MoE-only layers among them).
HYBRID_TYPES = frozenset(
    {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "granitemoehybrid", "nemotron_h", "falcon_h1", "lfm2"}
)
HYBRID_LAYERS = frozenset({"linear_attention", "mamba", "conv", "hybrid", "mlp", "moe"})
# Model types with state-space or linear-attention layers (whose state is no KV), by name, for
# configs that do not list their layer kinds in ``layer_types``.
RECURRENT_TYPES = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "jamba",
        "bamba",
        "zamba",
        "zamba2",
        "falcon_h1",
        "granitemoehybrid",
        "nemotron_h",
        "qwen3_next",
        "lfm2",
        "plamo2",
        "minimax",
        "recurrent_gemma",
        "rwkv",
        "xlstm",
    }
)


@dataclass(frozen=True)
class AttentionFeatures:
    """Per layer, its window (None: global) once windows at or above the context are dropped;
    the logit softcap; whether layers carry sink logits."""

    windows: tuple[int | None, ...]
    softcap: float | None
    sinks: bool

    def describe(self) -> str:
        counts = Counter(self.windows)
        parts = [
            f"{n} layers with a {w}-token window" if w else f"{n} global layers"
            for w, n in sorted(counts.items(), key=lambda item: item[0] or 0)
        ]
        if self.softcap:
            parts.append(f"logit softcap {self.softcap:g}")
        if self.sinks:
            parts.append("attention sinks")
        return ", ".join(parts)


def architecture_name(config: Any) -> str:
    """``Gemma4ForCausalLM (gemma4_text)``: a config's architectures and model type, for one-line
    refusals."""
    kind = getattr(config, "model_type", "?")
    names = ", ".join(getattr(config, "architectures", None) or []) or kind
    return f"{names} ({kind})"


def folder_architecture(model: str | None) -> str:
    """:func:`architecture_name` of the config ``--model`` names (read from disk, never
    downloaded), or the ``--model`` argument itself when its config cannot be read."""
    if model is None:
        return "the default model"
    try:
        return architecture_name(AutoConfig.from_pretrained(model, local_files_only=True))
    except Exception:  # a GGUF file, a missing or unreadable config: name what was asked for
        return f"--model {model}"


def unexpected_load_error(error: Exception, model: str | None) -> ModelLoadError:
    """The one-line refusal for an exception loading ``model`` did not expect (a bug or an
    architecture the worker does not know): the architecture, the exception's type and the first
    line of its message. The traceback goes to the DEBUG log only."""
    log.debug("loading %s raised", model, exc_info=error)
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return ModelLoadError(
        f"{folder_architecture(model)} cannot be served: loading it raised {type(error).__name__}: {first}"
    )


def _refusal(config: Any) -> str | None:
    """Why the paged attention cannot serve this config, or None."""
    kind = getattr(config, "model_type", "?")
    names = ", ".join(getattr(config, "architectures", None) or []) or kind
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        key_dim = getattr(config, "qk_head_dim", None) or (
            (getattr(config, "qk_nope_head_dim", 0) or 0) + (getattr(config, "qk_rope_head_dim", 0) or 0)
        )
        value_dim = getattr(config, "v_head_dim", None)
        return (
            f"{names} ({kind}) uses multi-head latent attention (MLA: key dim {key_dim}, value dim "
            f"{value_dim}), which the paged KV cache does not support yet"
        )
    layer_types = set(getattr(config, "layer_types", None) or ())
    served = kind in HYBRID_TYPES and layer_types <= ATTENTION_LAYERS | HYBRID_LAYERS
    others = sorted(layer_types - ATTENTION_LAYERS)
    if not served and (kind in RECURRENT_TYPES or others or getattr(config, "layers_block_type", None)):
        what = (
            f"layers of kind {', '.join(others)}"
            if others
            else "state-space (Mamba) or linear-attention layers"
        )
        return f"{names} ({kind}) is a hybrid or recurrent model ({what}), which Sluice does not serve yet"
    if getattr(config, "attention_chunk_size", None):
        return f"{names} ({kind}) uses chunked local attention, which the paged KV cache does not support yet"
    if getattr(config, "use_bidirectional_attention", None) == "all":
        return f"{names} ({kind}) attends bidirectionally (an encoder), which causal serving does not do"
    for layer in layer_configs(config):
        head_dim = getattr(layer, "head_dim", None)
        value_dim = getattr(layer, "v_head_dim", None)
        if head_dim and value_dim and value_dim != head_dim:
            return (
                f"{names} ({kind}) has key dim {head_dim} and value dim {value_dim}; "
                "the KV pool needs them equal"
            )
    try:
        kv_sources(config)
    except ValueError as error:
        return f"{names} ({kind}): {error}"
    return None


def check_attention(model: Any, context_length: int | None = None) -> AttentionFeatures:
    """The attention features of ``model`` (a transformers causal LM), logged in one line; raises
    :class:`ModelLoadError` naming the architecture when the paged attention cannot serve it."""
    config = model.config.get_text_config()
    reason = _refusal(config)
    if reason is not None:
        raise ModelLoadError(reason)
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * layers
    windows = tuple(
        int(window)
        if window and kind == "sliding_attention" and (context_length is None or window < context_length)
        else None
        for kind in layer_types
    )
    features = AttentionFeatures(
        windows,
        getattr(config, "attn_logit_softcapping", None),
        any(hasattr(module, "sinks") for module in model.modules()),
    )
    log.info("attention: %s", features.describe())
    return features
