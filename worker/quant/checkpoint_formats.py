"""A pre-quantized checkpoint's format, read from its config.json's ``quantization_config``:
compressed-tensors (``float-quantized`` FP8, ``pack-quantized`` int4/int8), GPTQ, AWQ, block-wise FP8
and gpt-oss's MXFP4 experts; each option not served in its own form is refused in one line naming it.
Design notes: docs/worker.md ("Pre-quantized checkpoints")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The CPU int4 kernel's group sizes (torch's _weight_int4pack_mm_for_cpu).
INT4_GROUPS = (32, 64, 128, 256)


class UnsupportedCheckpoint(ValueError):
    """A quantized checkpoint's format or option that the worker does not serve."""


@dataclass(frozen=True)
class CheckpointFormat:
    """What a quantized checkpoint holds: ``scheme`` (the worker's layer: ``fp8``, ``int4`` or
    ``int8``), ``name`` (the format as logged), ``group`` (int4's input columns per scale)."""

    method: str  # compressed-tensors, gptq, awq, fp8 (block-wise) or mxfp4
    name: str
    scheme: str
    group: int = 0
    fp8_activations: bool = False  # FP8 dynamic: inputs rounded to e4m3 per token
    fp8_input_group: int = 0  # FP8 block (compressed-tensors): per group of this many columns instead
    gptq_zero_offset: int = 0  # GPTQ v1 ("gptq") stores each zero point minus one
    zero_points: bool = False  # compressed-tensors: asymmetric, a packed ``weight_zero_point``
    block: tuple[int, int] = (0, 0)  # block-wise FP8: the rows and columns under one scale
    warning: str = ""  # what serving it this way costs, logged at load


def read_format(folder: Path) -> CheckpointFormat | None:
    """The folder's quantization format, None for a float checkpoint; raises
    :class:`UnsupportedCheckpoint` naming the option it cannot serve."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quantization)
    if method == "gptq":
        return _gptq(quantization)
    if method == "awq":
        return _awq(quantization)
    if method == "fp8":
        return _fp8_blocks(quantization)
    if method == "mxfp4":
        return _mxfp4(quantization, config.get("model_type"))
    raise UnsupportedCheckpoint(
        f"quantization_config.quant_method {method!r} is not served "
        "(compressed-tensors, gptq, awq, fp8 and mxfp4 are)"
    )


def _refuse(option: str, why: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"quantized checkpoint: {option} is not supported ({why})")


def _only_group(quantization: dict[str, Any]) -> dict[str, Any]:
    """The one config group of a compressed-tensors checkpoint, its wider options checked."""
    for option in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if quantization.get(option):
            raise _refuse(option, "only weight quantization is served")
    groups = quantization.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(f"config_groups with {len(groups)} groups", "one scheme for every layer is served")
    group: dict[str, Any] = next(iter(groups.values()))
    if group.get("output_activations"):
        raise _refuse("output_activations", "only weight quantization is served")
    return group


def _fp8_activations(activations: dict[str, Any] | None) -> int | None:
    """The columns per scale of dynamic FP8 inputs (0: per token), None without input quantization;
    other activation schemes are refused."""
    if not activations:
        return None
    if (
        activations.get("type") == "float"
        and activations.get("num_bits") == 8
        and activations.get("dynamic") is True
        and activations.get("strategy") in ("token", "group")
    ):
        return int(activations.get("group_size") or 0) if activations["strategy"] == "group" else 0
    kind = f"{activations.get('type')}{activations.get('num_bits')}"
    raise _refuse(f"input_activations {kind} (W8A8-style activation quantization)", "weight-only is served")


def _compressed_tensors(quantization: dict[str, Any]) -> CheckpointFormat:
    group = _only_group(quantization)
    layout = group.get("format") or quantization.get("format")
    weights = group.get("weights") or {}
    input_group = _fp8_activations(group.get("input_activations"))
    fp8_inputs = input_group is not None
    if fp8_inputs and not (layout == "float-quantized" and weights.get("type") == "float"):
        raise _refuse("input_activations fp8 with integer weights", "fp8 inputs are served with fp8 weights")
    asymmetric = weights.get("symmetric") is False
    if asymmetric and not (layout == "pack-quantized" and weights.get("num_bits") == 4):
        raise _refuse(
            "weights.symmetric: false (asymmetric zero points) outside 4-bit pack-quantized",
            "int4 groups take zero points",
        )
    # "weight" and "static" only order GPTQ's work over the columns: the groups stay contiguous and no
    # g_idx is saved. "group" and "dynamic" permute the groups (compressed-tensors 0.20 refuses them too).
    actorder = weights.get("actorder")
    if actorder not in (None, False, "weight", "static"):
        raise _refuse(f"weights.actorder {actorder!r}", "act-order 'weight' and 'static' are served")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if layout == "float-quantized" and kind == "float" and bits == 8:
        if strategy == "block":
            return _compressed_fp8_blocks(weights, fp8_inputs, input_group or 0)
        if strategy not in ("channel", "tensor"):
            raise _refuse(
                f"fp8 weights.strategy {strategy!r}", "per-channel, per-tensor and block scales are served"
            )
        if input_group:
            raise _refuse("fp8 input_activations per group with channel weights", "per token is served")
        name = f"compressed-tensors {layout} fp8 ({strategy}{', dynamic fp8 inputs' if fp8_inputs else ''})"
        return CheckpointFormat("compressed-tensors", name, "fp8", fp8_activations=fp8_inputs)
    if layout == "pack-quantized" and kind == "int" and bits == 4:
        size = int(weights.get("group_size") or 0)
        if strategy != "group" or size not in INT4_GROUPS:
            raise _refuse(f"int4 weights.strategy {strategy!r} group_size {size}", f"groups of {INT4_GROUPS}")
        name = f"compressed-tensors {layout} int4 g{size}{' asymmetric' if asymmetric else ''}"
        name += f", act-order {actorder!r}" if actorder else ""
        return CheckpointFormat("compressed-tensors", name, "int4", size, zero_points=asymmetric)
    if layout == "pack-quantized" and kind == "int" and bits == 8 and strategy == "channel":
        return CheckpointFormat("compressed-tensors", f"compressed-tensors {layout} int8 (channel)", "int8")
    raise _refuse(f"format {layout!r} with {kind} weights of {bits} bits ({strategy})", "see docs/models.md")


def _compressed_fp8_blocks(weights: dict[str, Any], fp8_inputs: bool, input_group: int) -> CheckpointFormat:
    """compressed-tensors' FP8-block scheme: e4m3 weights under one scale per ``block_structure``
    tile, the inputs rounded to e4m3 per group of columns (or per token) as the checkpoint says."""
    block = weights.get("block_structure")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)):
        raise _refuse(f"fp8 weights.strategy 'block' with block_structure {block!r}", "two block sizes")
    rows, columns = block
    inputs = f", dynamic fp8 inputs per {input_group or 'token'}" if fp8_inputs else ""
    name = f"compressed-tensors float-quantized fp8 {rows}x{columns} blocks{inputs}"
    return CheckpointFormat(
        "compressed-tensors", name, "fp8", fp8_activations=fp8_inputs, fp8_input_group=input_group,
        block=(rows, columns),
    )  # fmt: skip


def _gptq(quantization: dict[str, Any]) -> CheckpointFormat:
    bits = quantization.get("bits")
    if bits != 4:
        raise _refuse(f"GPTQ bits {bits}", "4-bit GPTQ is served")
    layout = quantization.get("checkpoint_format", "gptq")
    if layout not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format {layout!r}", "gptq and gptq_v2 are served")
    size = int(quantization.get("group_size") or -1)
    if size not in INT4_GROUPS:
        raise _refuse(f"GPTQ group_size {size}", f"groups of {INT4_GROUPS} are served")
    offset = 1 if layout == "gptq" else 0
    order = ", act-order" if quantization.get("desc_act") else ""
    name = f"GPTQ ({layout}) int4 g{size}{order}"
    return CheckpointFormat("gptq", name, "int4", size, gptq_zero_offset=offset)


def _awq(quantization: dict[str, Any]) -> CheckpointFormat:
    """AutoAWQ's GEMM layout (what llm-awq, AutoAWQ and gptqmodel write): 4 bits with zero points."""
    bits, version = quantization.get("bits", quantization.get("w_bit")), quantization.get("version", "gemm")
    if bits != 4:
        raise _refuse(f"AWQ bits {bits}", "4-bit AWQ is served")
    if str(version).lower() != "gemm":
        raise _refuse(f"AWQ version {version!r}", "the GEMM layout is served")
    if quantization.get("zero_point", True) is False:
        raise _refuse("AWQ zero_point: false", "AWQ with zero points is served")
    size = int(quantization.get("group_size", quantization.get("q_group_size")) or -1)
    if size not in INT4_GROUPS:
        raise _refuse(f"AWQ group_size {size}", f"groups of {INT4_GROUPS} are served")
    return CheckpointFormat("awq", f"AWQ (gemm) int4 g{size}", "int4", size)


def _fp8_blocks(quantization: dict[str, Any]) -> CheckpointFormat:
    """transformers' fine-grained FP8 (``weight_block_size``, ``weight_scale_inv``): served weight-only,
    the checkpoint's dynamic FP8 inputs left unrounded (said at load); static input scales refused."""
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)):
        raise _refuse(f"fp8 weight_block_size {block!r}", "two block sizes (rows, columns) are served")
    scheme = quantization.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(f"fp8 activation_scheme {scheme!r}", "dynamic activations are served")
    rows, columns = block
    warning = (
        f"fp8 {rows}x{columns} blocks served weight-only: the inputs are not rounded to fp8 per "
        f"{columns}-column group as the checkpoint's dynamic activations would be (more precise, "
        "no faster: each product upcasts its weight)"
    )
    name = f"fp8 block-wise {rows}x{columns} (quant_method fp8)"
    return CheckpointFormat("fp8", name, "fp8", block=(rows, columns), warning=warning)


# transformers' Mxfp4Config: what it saves, and its load option ``dequantize``.
_MXFP4_OPTIONS = ("quant_method", "modules_to_not_convert", "dequantize")


def _mxfp4(quantization: dict[str, Any], model_type: str | None) -> CheckpointFormat:
    """gpt-oss's MXFP4 experts, served packed (worker/quant/mxfp4.py); another model type or an
    option Mxfp4Config does not have is refused; ``dequantize`` (a load option) is said to be unused."""
    if model_type != "gpt_oss":
        raise _refuse(
            f"quant_method 'mxfp4' on model_type {model_type!r}", "gpt-oss's MXFP4 experts are served"
        )
    extra = sorted(set(quantization) - set(_MXFP4_OPTIONS))
    if extra:
        raise _refuse(f"mxfp4 option {extra[0]!r}", f"Mxfp4Config's {', '.join(_MXFP4_OPTIONS)} are read")
    warning = ""
    if quantization.get("dequantize"):
        warning = (
            "mxfp4 dequantize: true (transformers' load option) is not followed: the experts stay packed"
        )
    name = "mxfp4 experts (e2m1 in blocks of 32 under e8m0 scales; the rest float)"
    return CheckpointFormat("mxfp4", name, "mxfp4", group=32, warning=warning)
