"""Building a quantized model one tensor at a time, from a GGUF file or a safetensors folder.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM

from worker.quant.gguf_blocks import GGUFMatrix, dequantized, int8_from_q8_0, repacked_linear
from worker.quant.gguf_file import read_gguf
from worker.quant.layers import Int8Embedding, Int8Linear, quantize_weight
from worker.quant.slicing import WHOLE, Slicer

log = logging.getLogger(__name__)


class DirectLoadUnsupported(Exception):
    """This checkpoint cannot be quantized tensor by tensor; load it whole instead."""


# GGUF tensor names of the llama architecture (llama.cpp's naming) -> transformers module paths.
_LLAMA_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LLAMA_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight$")


def llama_module_path(gguf_name: str) -> str | None:
    """The transformers module a llama GGUF weight belongs to, or None."""
    match = _BLOCK_NAME.match(gguf_name)
    if match:
        inner = _LLAMA_BLOCK.get(match.group(2))
        return f"model.layers.{match.group(1)}.{inner}" if inner else None
    if gguf_name.endswith(".weight"):
        return _LLAMA_GLOBAL.get(gguf_name[: -len(".weight")])
    return None


def unpermuted_rows(out_features: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's rotary permutation of the q/k projections.

    llama.cpp's converter reorders each head's rows from halves (0..d/2-1, d/2..d-1) to
    interleaved pairs; transformers undoes it on the float weights, and whole rows (which hold
    whole quantized blocks) can be reordered the same way without touching the blocks.
    """
    half = out_features // heads // 2
    order = np.arange(out_features).reshape(heads, half, 2).swapaxes(1, 2)
    return order.reshape(out_features)


def _set_module(model: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, module)


def _set_parameter(model: torch.nn.Module, path: str, value: torch.Tensor) -> None:
    module_path, _, name = path.rpartition(".")
    try:
        module = model.get_submodule(module_path)
    except AttributeError:  # a checkpoint name transformers converts at load (fused MoE experts)
        raise DirectLoadUnsupported(f"{path} is no module path of the model") from None
    if name in module._parameters:
        module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    elif name in module._buffers:
        module._buffers[name] = value
    else:
        raise DirectLoadUnsupported(f"{path} is neither a parameter nor a buffer of the model")


def _empty_model(config: Any) -> torch.nn.Module:
    """The causal LM of ``config`` on the meta device; a vision-language config (its weights under
    the multimodal model's own names) loads in float first."""
    if getattr(config, "vision_config", None) is not None:
        raise DirectLoadUnsupported("a vision-language checkpoint is read by its own model class")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _finish(model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """Recreates the rotary embedding (its buffers are computed, not stored) and checks that no
    tensor is left on the meta device."""
    for path, module in list(model.named_modules()):
        if path.endswith("rotary_emb"):
            _set_module(model, path, type(module)(config=config))
    left = [
        name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"
    ]
    if left:
        raise DirectLoadUnsupported(f"the checkpoint does not provide {', '.join(left[:5])}")
    return model.eval()


def _tie_output(model: torch.nn.Module, config: Any, embedding: torch.Tensor | None, scheme: str) -> None:
    """A tied output layer becomes one int8 table serving both the output layer and the embedding."""
    if embedding is None:
        raise DirectLoadUnsupported("the checkpoint has neither an output layer nor an embedding")
    output = quantize_weight("int8" if scheme == "int4" else scheme, embedding)
    model.lm_head = output
    if isinstance(output, Int8Linear):
        _set_module(model, "model.embed_tokens", Int8Embedding(output))
    else:
        _set_parameter(model, "model.embed_tokens.weight", embedding)


@torch.no_grad()
def load_gguf_quantized(gguf: Path, config: Any, scheme: str, slicer: Slicer = WHOLE) -> torch.nn.Module:
    """A llama-architecture GGUF file as a CPU model with quantized linear layers.

    Q4_0/Q4_1 weights keep their 4-bit values and Q8_0 weights their 8-bit ones (see
    worker/quant/gguf_blocks.py); the norms are float32. ``scheme`` is ``int8`` or ``int4``.
    ``slicer``: a tensor-parallel rank's, which keeps its share of each decoder projection (the
    embedding and output layer stay whole).
    """
    reader = read_gguf(gguf)
    architecture = reader.architecture
    if architecture != "llama" or getattr(config, "model_type", None) != "llama":
        raise DirectLoadUnsupported(f"direct GGUF loading knows the llama architecture, not {architecture}")
    model = _empty_model(config)
    tensors: dict[str, GGUFMatrix] = {}
    for entry in reader.tensors:
        path = llama_module_path(entry.name)
        if path is None:
            raise DirectLoadUnsupported(f"GGUF tensor {entry.name} has no place in the model")
        tensors[path] = entry
    for path, tensor in tensors.items():
        module = model.get_submodule(path)
        if isinstance(module, torch.nn.Linear):
            rows = None
            if path.endswith("q_proj"):
                rows = unpermuted_rows(module.out_features, config.num_attention_heads)
            elif path.endswith("k_proj"):
                rows = unpermuted_rows(module.out_features, config.num_key_value_heads)
            cut = slicer if path.startswith("model.layers.") else WHOLE
            _set_module(model, path, repacked_linear(tensor, scheme, rows, cut, path))
        elif path != "model.embed_tokens":
            _set_parameter(model, f"{path}.weight", dequantized(tensor))
    embedding = tensors.get("model.embed_tokens")
    if "lm_head" in tensors:
        if embedding is not None:
            _set_parameter(model, "model.embed_tokens.weight", dequantized(embedding))
    elif embedding is not None and embedding.tensor_type == GGMLQuantizationType.Q8_0:
        output = int8_from_q8_0(embedding)  # shared with the embedding
        model.lm_head = output
        _set_module(model, "model.embed_tokens", Int8Embedding(output))
    else:
        _tie_output(model, config, None if embedding is None else dequantized(embedding), scheme)
    return _finish(model, config)


@torch.no_grad()
def load_folder_quantized(folder: Path, config: Any, scheme: str) -> torch.nn.Module:
    """A Hugging Face folder's safetensors weights, each linear layer quantized as it is read."""
    from safetensors import safe_open

    files = _safetensors_files(folder)
    model = _empty_model(config)
    linears = {path for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    embedding: torch.Tensor | None = None
    has_output = False
    biases: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                module_path, _, name = key.rpartition(".")
                value = handle.get_tensor(key).float()
                if module_path in linears and name == "weight":
                    layer_scheme = "int8" if scheme == "int4" and module_path == "lm_head" else scheme
                    _set_module(model, module_path, quantize_weight(layer_scheme, value))
                    has_output = has_output or module_path == "lm_head"
                elif module_path in linears and name == "bias":
                    biases[module_path] = value
                elif key == "model.embed_tokens.weight":
                    embedding = value
                else:
                    _set_parameter(model, key, value)
    for module_path, bias in biases.items():
        model.get_submodule(module_path).bias = bias
    if has_output:
        if embedding is not None:
            _set_parameter(model, "model.embed_tokens.weight", embedding)
    else:
        _tie_output(model, config, embedding, scheme)
    return _finish(model, config)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise DirectLoadUnsupported(f"{folder} has no safetensors weights")
