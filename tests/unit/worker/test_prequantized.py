"""Pre-quantized checkpoints (worker/quant/checkpoint_formats.py, checkpoint_loading.py): each
format's options read or refused by name, and each format's tensors, packed here the way its tool
packs them (a fake of the tool's output; tests/integration/test_prequantized_worker.py serves the
real tools' checkpoints), mapped into layers that hold the same weight."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.model.loader import ModelLoadError, load_model
from worker.model.prequantized import checkpoint_format
from worker.quant.act_order import ActOrderInt4Linear
from worker.quant.checkpoint_formats import CheckpointFormat, UnsupportedCheckpoint, read_format
from worker.quant.checkpoint_loading import (
    awq_layer,
    compressed_tensors_layer,
    gptq_layer,
    unpack_awq,
    unpack_int32,
)
from worker.quant.fp8_activations import fp8_per_token
from worker.quant.fp8_blocks import fp8_block_layer

W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
            },
            "input_activations": None,
        }
    },
}
FP8_DYNAMIC = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
# What gptqmodel writes for AWQ (AutoAWQ's own config has the same four keys).
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
# transformers' fine-grained FP8, as Qwen3-8B-FP8's config.json has it.
FP8_BLOCKS = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def _folder(tmp_path: Path, quantization: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": quantization})
    )
    return tmp_path


def _with(config: dict[str, Any], **weights: Any) -> dict[str, Any]:
    changed = json.loads(json.dumps(config))
    changed["config_groups"]["group_0"]["weights"].update(weights)
    return changed


def test_each_format_is_read(tmp_path: Path) -> None:
    assert read_format(_folder(tmp_path, W4A16)) == CheckpointFormat(
        "compressed-tensors", "compressed-tensors pack-quantized int4 g32", "int4", 32
    )
    fp8 = read_format(_folder(tmp_path, FP8_DYNAMIC))
    assert fp8 is not None and (fp8.scheme, fp8.fp8_activations) == ("fp8", True)
    gptq = read_format(_folder(tmp_path, GPTQ))
    assert gptq is not None and (gptq.scheme, gptq.group, gptq.gptq_zero_offset) == ("int4", 32, 1)
    asymmetric = read_format(_folder(tmp_path, _with(W4A16, symmetric=False)))
    assert asymmetric is not None and (asymmetric.scheme, asymmetric.zero_points) == ("int4", True)
    assert read_format(_folder(tmp_path, AWQ)) == CheckpointFormat("awq", "AWQ (gemm) int4 g32", "int4", 32)
    blocks = read_format(_folder(tmp_path, FP8_BLOCKS))
    assert blocks is not None and (blocks.method, blocks.scheme, blocks.block) == ("fp8", "fp8", (128, 128))
    act_order = read_format(_folder(tmp_path, {**GPTQ, "desc_act": True}))
    assert act_order is not None and act_order.name.endswith("act-order")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert read_format(tmp_path) is None


W8A8 = json.loads(json.dumps(FP8_DYNAMIC))
W8A8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": True}


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        (_with(W4A16, symmetric=False, num_bits=8, strategy="channel"), "weights.symmetric: false"),
        (_with(W4A16, num_bits=3), "3 bits"),
        (_with(W4A16, group_size=48), "group_size 48"),
        (_with(W4A16, actorder="group"), "weights.actorder 'group'"),
        (_with(FP8_DYNAMIC, strategy="block"), "strategy 'block'"),
        (W8A8, "input_activations int8"),
        ({**W4A16, "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
        ({**GPTQ, "bits": 8}, "GPTQ bits 8"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"quant_method": "mxfp4"}, "quant_method 'mxfp4'"),
        ({**FP8_BLOCKS, "weight_block_size": None}, "fp8 weight_block_size None"),
        ({**FP8_BLOCKS, "activation_scheme": "static"}, "fp8 activation_scheme 'static'"),
        ({**AWQ, "version": "gemv"}, "AWQ version 'gemv'"),
        ({**AWQ, "bits": 8}, "AWQ bits 8"),
        ({**AWQ, "zero_point": False}, "AWQ zero_point: false"),
        ({**AWQ, "group_size": 48}, "AWQ group_size 48"),
    ],
)
def test_unsupported_options_are_refused_by_name(
    tmp_path: Path, quantization: dict[str, Any], named: str
) -> None:
    with pytest.raises(UnsupportedCheckpoint, match=named.replace("(", r"\(")) as refused:
        read_format(_folder(tmp_path, quantization))
    assert "\n" not in str(refused.value)


def _pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs unsigned ``bits``-bit values along the last dimension, the first in the lowest bits."""
    per_word = 32 // bits
    grouped = values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word)
    words = (grouped << (torch.arange(per_word) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_unpack_int32_reads_the_lowest_bits_first() -> None:
    values = torch.randint(0, 16, (3, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int32(_pack_int32(values, 4), 4), values.to(torch.int32))
    assert torch.equal(unpack_int32(torch.tensor([[0x76543210]], dtype=torch.int32), 4)[0], torch.arange(8))


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing, written from its format description: eight 4-bit values per int32 along
    the last dimension, nibble ``i`` of a word holding column ``(0, 2, 4, 6, 1, 3, 5, 7)[i]`` of its 8."""
    words = values.reshape(*values.shape[:-1], -1, 8)[..., [0, 2, 4, 6, 1, 3, 5, 7]]
    return _pack_int32(words.reshape(values.shape), 4)


def test_unpack_awq_reads_autoawqs_nibble_order() -> None:
    # Columns 0..7 holding the values 0..7: the word's nibbles, lowest first, are 0 2 4 6 1 3 5 7.
    assert torch.equal(unpack_awq(torch.tensor([[0x75316420]], dtype=torch.int32))[0], torch.arange(8))
    values = torch.randint(0, 16, (3, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_awq(_pack_awq(values)), values.to(torch.int32))


def _int4(out: int = 32, inp: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (out, inp), generator=generator)
    scale = torch.rand(inp // 32, out, generator=generator) * 0.1 + 0.01  # [groups, out]
    return q, scale


def _grouped(q: torch.Tensor, per_group: torch.Tensor) -> torch.Tensor:
    return per_group.t().repeat_interleave(32, dim=1)  # [out, in]


def test_a_pack_quantized_layer_holds_the_checkpoints_weight() -> None:
    q, scale = _int4()
    parts = {
        "weight_packed": _pack_int32(q, 4),
        "weight_scale": scale.t().contiguous(),
        "weight_shape": torch.tensor(q.shape),
    }
    layer = compressed_tensors_layer(parts, CheckpointFormat("compressed-tensors", "", "int4", 32), "x")
    expected = (q.float() - 8) * _grouped(q, scale.to(torch.bfloat16).float())
    torch.testing.assert_close(layer.dequantized(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("layout_offset", [1, 0])
def test_a_gptq_layer_holds_the_checkpoints_weight(layout_offset: int) -> None:
    q, scale = _int4()
    zero = torch.randint(1, 15, scale.shape, generator=torch.Generator().manual_seed(2))
    # GPTQ packs the input dimension: qweight [in / 8, out]; qzeros [groups, out / 8] (v1: minus one).
    parts = {
        "qweight": _pack_int32(q, 4).t().contiguous(),
        "qzeros": _pack_int32(zero - layout_offset, 4),
        "scales": scale.half(),
        "g_idx": torch.arange(64, dtype=torch.int32) // 32,
    }
    fmt = CheckpointFormat("gptq", "", "int4", 32, gptq_zero_offset=layout_offset)
    layer = gptq_layer(parts, fmt, "x")
    expected = (q.float() - _grouped(q, zero.float())) * _grouped(q, scale.half().float())
    torch.testing.assert_close(layer.dequantized(), expected, atol=2e-2, rtol=2e-2)


def _zeros(scale: torch.Tensor) -> torch.Tensor:
    return torch.randint(0, 16, scale.shape, generator=torch.Generator().manual_seed(2))


def test_an_asymmetric_pack_quantized_layer_holds_the_checkpoints_weight() -> None:
    q, scale = _int4()
    zero = _zeros(scale)  # [groups, out], unsigned (each the signed zero point plus 8)
    parts = {
        "weight_packed": _pack_int32(q, 4),
        "weight_scale": scale.t().contiguous(),
        "weight_shape": torch.tensor(q.shape),
        # compressed-tensors packs the zero points along the output rows: [out / 8, groups].
        "weight_zero_point": _pack_int32(zero, 4).t().contiguous(),
    }
    fmt = CheckpointFormat("compressed-tensors", "", "int4", 32, zero_points=True)
    layer = compressed_tensors_layer(parts, fmt, "x")
    expected = (q.float() - _grouped(q, zero.float())) * _grouped(q, scale.to(torch.bfloat16).float())
    torch.testing.assert_close(layer.dequantized(), expected, atol=2e-2, rtol=2e-2)
    with pytest.raises(UnsupportedCheckpoint, match="x: an asymmetric scheme without weight_zero_point"):
        compressed_tensors_layer({k: v for k, v in parts.items() if k != "weight_zero_point"}, fmt, "x")


def test_an_awq_layer_holds_the_checkpoints_weight() -> None:
    q, scale = _int4()
    zero = _zeros(scale)
    # AWQ packs the output dimension: qweight [in, out / 8], qzeros [groups, out / 8], no offset.
    parts = {"qweight": _pack_awq(q.t().contiguous()), "qzeros": _pack_awq(zero), "scales": scale.half()}
    layer = awq_layer(parts, CheckpointFormat("awq", "", "int4", 32), "x")
    expected = (q.float() - _grouped(q, zero.float())) * _grouped(q, scale.half().float())
    torch.testing.assert_close(layer.dequantized(), expected, atol=2e-2, rtol=2e-2)


def _act_order_parts() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A GPTQ act-order layer (``g_idx`` a shuffled assignment of the inputs to groups) and its weight."""
    q, scale = _int4()
    zero = _zeros(scale).clamp(min=1)  # GPTQ v1 stores each zero minus one
    g_idx = (torch.arange(64) // 32)[torch.randperm(64, generator=torch.Generator().manual_seed(3))]
    parts = {
        "qweight": _pack_int32(q, 4).t().contiguous(),
        "qzeros": _pack_int32(zero - 1, 4),
        "scales": scale.half(),
        "g_idx": g_idx.to(torch.int32),
    }
    weight = (q.float() - zero.float()[g_idx].t()) * scale.half().float()[g_idx].t()
    return parts, weight


def test_a_gptq_act_order_layer_permutes_its_inputs_into_groups() -> None:
    parts, weight = _act_order_parts()
    layer = gptq_layer(parts, CheckpointFormat("gptq", "", "int4", 32, gptq_zero_offset=1), "x")
    assert isinstance(layer, ActOrderInt4Linear)
    torch.testing.assert_close(layer.dequantized(), weight, atol=2e-2, rtol=2e-2)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(layer(x), x @ weight.t(), atol=5e-2, rtol=2e-2)


def test_a_gptq_g_idx_with_uneven_groups_is_refused() -> None:
    parts, _ = _act_order_parts()
    parts["g_idx"] = torch.cat([torch.zeros(40), torch.ones(24)]).to(torch.int32)
    with pytest.raises(
        UnsupportedCheckpoint, match=r"model\.layers\.0\.mlp\.up_proj\.g_idx: groups of other"
    ):
        gptq_layer(
            parts, CheckpointFormat("gptq", "", "int4", 32, gptq_zero_offset=1), "model.layers.0.mlp.up_proj"
        )


def test_a_block_fp8_layer_holds_the_checkpoints_weight() -> None:
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(48, 64, generator=generator) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, generator=generator) + 0.01  # 32 x 32 blocks; the last row of blocks is half
    layer = fp8_block_layer({"weight": weight, "weight_scale_inv": scale}, (32, 32), "x")
    expected = weight.float() * scale.repeat_interleave(32, 0)[:48].repeat_interleave(32, 1)
    torch.testing.assert_close(layer.dequantized(), expected)
    x = torch.randn(3, 64, generator=generator)
    torch.testing.assert_close(layer(x), x @ expected.t(), atol=1e-3, rtol=1e-4)
    with pytest.raises(
        UnsupportedCheckpoint, match=r"x.weight_scale_inv has shape \(2, 1\), not the \(2, 2\)"
    ):
        fp8_block_layer({"weight": weight, "weight_scale_inv": scale[:, :1]}, (32, 32), "x")


def test_block_fp8_says_at_load_what_serving_it_weight_only_costs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fmt = checkpoint_format(_folder(tmp_path, FP8_BLOCKS), "auto", "generate")
    assert fmt is not None and fmt.block == (128, 128)
    assert "inputs are not rounded to fp8 per 128-column group" in caplog.text


def test_fp8_per_token_rounds_each_row_under_its_own_scale() -> None:
    rows = torch.tensor([[448.0, 1.0, -0.3], [0.001, 0.0, -0.002], [0.0, 0.0, 0.0]])
    rounded = fp8_per_token(rows)
    # Each row's largest magnitude is exact; the rest round to e4m3's 3 mantissa bits of that scale.
    assert rounded[0, 0] == 448.0 and rounded[1, 2] == pytest.approx(-0.002)
    torch.testing.assert_close(rounded, rows, atol=0.0, rtol=2**-4)
    assert torch.equal(rounded[2], rows[2])


@pytest.mark.parametrize("asked", ["int8", "none", "fp8"])
def test_a_quantized_checkpoint_with_another_quantization_is_refused(tmp_path: Path, asked: str) -> None:
    with pytest.raises(ModelLoadError, match=f"--quantization {asked}: .* pack-quantized int4") as refused:
        load_model(str(_folder(tmp_path, W4A16)), device="cpu", quantization=asked)
    assert refused.value.param == "quantization"


def test_a_quantized_checkpoint_for_a_pooling_task_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="--task embed serves float checkpoints only"):
        load_model(str(_folder(tmp_path, W4A16)), device="cpu", task="embed")
