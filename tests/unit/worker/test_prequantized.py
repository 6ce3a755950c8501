"""Pre-quantized checkpoints (worker/quant/checkpoint_formats.py, checkpoint_loading.py): each
format's options read or refused by name, and each format's tensors, packed here the way its tool
packs them (a fake of the tool's output; tests/integration/test_prequantized_worker.py serves the
real tools' checkpoints), mapped into layers that hold the same weight; gpt-oss's MXFP4 experts
packed by tools/quant_fixtures.py's writer and computing as transformers' experts do."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tools.quant_fixtures import MXFP4_CONFIG, mxfp4_pack
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
from worker.quant.mxfp4 import E2M1, Mxfp4Experts, dequantize_mxfp4, float16_bytes, load_mxfp4_experts

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
    for order in ("weight", "static"):  # GPTQ's column order only: the groups stay as they are
        served = read_format(_folder(tmp_path, _with(W4A16, actorder=order)))
        assert served is not None and (served.scheme, served.group) == ("int4", 32)
        assert served.name.endswith(f"act-order {order!r}")
    ct_blocks = json.loads(json.dumps(_with(FP8_DYNAMIC, strategy="block", block_structure=[128, 128])))
    ct_blocks["config_groups"]["group_0"]["input_activations"].update(strategy="group", group_size=128)
    fp8_block = read_format(_folder(tmp_path, ct_blocks))
    assert fp8_block is not None
    assert (fp8_block.block, fp8_block.fp8_activations, fp8_block.fp8_input_group) == ((128, 128), True, 128)
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
        (_with(W4A16, actorder="dynamic"), "weights.actorder 'dynamic'"),
        (_with(FP8_DYNAMIC, strategy="block"), "strategy 'block' with block_structure None"),
        (_with(FP8_DYNAMIC, strategy="group"), "fp8 weights.strategy 'group'"),
        (W8A8, "input_activations int8"),
        ({**W4A16, "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
        ({**GPTQ, "bits": 8}, "GPTQ bits 8"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"quant_method": "mxfp4"}, "quant_method 'mxfp4' on model_type 'llama'"),
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


def test_fp8_per_group_rounds_each_run_of_columns_under_its_own_scale() -> None:
    row = torch.tensor([[448.0, 1.0, 0.001, -0.0004]])
    per_group = fp8_per_token(row, 2)
    halves = torch.cat([fp8_per_token(row[:, :2]), fp8_per_token(row[:, 2:])], -1)
    torch.testing.assert_close(per_group, halves)
    assert per_group[0, 3] == pytest.approx(-0.0004, rel=2**-4)  # its own scale: one per row flushes it to 0
    assert fp8_per_token(row)[0, 3] == 0.0


@pytest.mark.parametrize("asked", ["int8", "none", "fp8"])
def test_a_quantized_checkpoint_with_another_quantization_is_refused(tmp_path: Path, asked: str) -> None:
    with pytest.raises(ModelLoadError, match=f"--quantization {asked}: .* pack-quantized int4") as refused:
        load_model(str(_folder(tmp_path, W4A16)), device="cpu", quantization=asked)
    assert refused.value.param == "quantization"


def test_a_quantized_checkpoint_for_a_pooling_task_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="--task embed serves float checkpoints only"):
        load_model(str(_folder(tmp_path, W4A16)), device="cpu", task="embed")


# gpt-oss's MXFP4 experts (worker/quant/mxfp4.py); tools/quant_fixtures.py's writer packs them.
def _gpt_oss_folder(tmp_path: Path, **options: Any) -> Path:
    quantization = {**MXFP4_CONFIG, **options}
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt_oss", "quantization_config": quantization})
    )
    return tmp_path


def test_mxfp4_is_read_on_gpt_oss_and_its_other_options_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fmt = read_format(_gpt_oss_folder(tmp_path))
    assert fmt is not None and (fmt.method, fmt.scheme, fmt.group, fmt.warning) == ("mxfp4", "mxfp4", 32, "")
    with pytest.raises(UnsupportedCheckpoint, match="mxfp4 option 'group_size' is not supported"):
        read_format(_gpt_oss_folder(tmp_path, group_size=64))
    checkpoint_format(_gpt_oss_folder(tmp_path, dequantize=True), "auto", "generate")
    assert "mxfp4 dequantize: true (transformers' load option) is not followed" in caplog.text
    with pytest.raises(ModelLoadError, match=r"with --quantization auto$"):
        load_model(str(_gpt_oss_folder(tmp_path)), device="cpu", quantization="int4")


def test_mxfp4_bytes_read_as_the_ocp_format_defines_them() -> None:
    # 0x2F: the low nibble (the first value) is code 15, -6; the high one code 2, 1.0; scale 2 ** (128 - 127).
    blocks = torch.full((1, 16), 0x2F, dtype=torch.uint8)
    values = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8), torch.bfloat16)
    assert values.dtype == torch.bfloat16 and torch.equal(values.float(), torch.tensor([-12.0, 2.0] * 16))
    # Every e2m1 value under scales from 2 ** -20 to 2 ** 20 survives the writer and the reader exactly.
    grid = torch.tensor(E2M1)[torch.randint(0, 16, (41, 64), generator=torch.Generator().manual_seed(6))]
    grid[:, ::32] = 6.0  # each block's largest magnitude fixes its scale
    weight = grid * torch.exp2(torch.arange(-20, 21).float())[:, None]
    assert torch.equal(dequantize_mxfp4(*mxfp4_pack(weight), torch.float32), weight)


def _tiny_experts() -> tuple[Any, Any]:
    """A float gpt-oss experts module (tests/tiny_families.py's config) and its config."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from tests.tiny_families import tiny_config

    config = tiny_config("gpt_oss")
    experts = GptOssExperts(config)
    generator = torch.Generator().manual_seed(7)
    for parameter in experts.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.3
    return experts, config


def _packed_parts(experts: Any) -> dict[str, torch.Tensor]:
    """The experts' checkpoint tensors as gpt-oss's releases hold them ([E, out, in] packed)."""
    parts: dict[str, torch.Tensor] = {}
    for projection in ("gate_up_proj", "down_proj"):
        blocks, scales = mxfp4_pack(getattr(experts, projection).detach().transpose(1, 2))
        parts |= {f"{projection}_blocks": blocks, f"{projection}_scales": scales}
        parts[f"{projection}_bias"] = getattr(experts, f"{projection}_bias").detach().clone()
    return parts


def test_mxfp4_experts_compute_as_gpt_oss_experts_on_the_same_weights() -> None:
    experts, config = _tiny_experts()
    packed = Mxfp4Experts(copy.deepcopy(experts), _packed_parts(experts))
    for projection in ("gate_up_proj", "down_proj"):  # the float module on the dequantized weights
        getattr(experts, projection).data = torch.stack(
            [packed.weight(projection, e, torch.float32).t() for e in range(config.num_local_experts)]
        )
    hidden = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(8))
    index = torch.tensor([[0, 1], [1, 3], [3, 0], [2, 1], [0, 2], [3, 1]])
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(
        packed(hidden, index, weights), experts(hidden, index, weights), atol=1e-5, rtol=1e-5
    )
    # An index of E (another rank's expert, as expert parallelism marks it) is skipped: as a weight of 0.
    elsewhere = index.clone()
    elsewhere[5, 1] = config.num_local_experts
    unweighted = weights.clone()
    unweighted[5, 1] = 0.0
    torch.testing.assert_close(
        packed(hidden, elsewhere, weights), experts(hidden, index, unweighted), atol=1e-5, rtol=1e-5
    )
    assert float16_bytes(packed) == 2 * experts.gate_up_proj.numel() + 2 * experts.down_proj.numel()


def test_mxfp4_tensors_outside_the_experts_or_misshapen_are_refused_by_name() -> None:
    experts, config = _tiny_experts()
    path = "model.layers.0.mlp.experts"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parts = {f"{path}.{name}": value for name, value in _packed_parts(experts).items()}
    stray = {**parts, "model.layers.0.self_attn.q_proj.weight_blocks": torch.zeros(1, dtype=torch.uint8)}
    with pytest.raises(
        UnsupportedCheckpoint, match=r"mxfp4: model\.layers\.0\.self_attn\.q_proj\.weight_blocks"
    ):
        load_mxfp4_experts(model, stray, config, torch.device("cpu"))
    halved = {**parts, f"{path}.down_proj_scales": parts[f"{path}.down_proj_scales"][:, :, :1]}
    with pytest.raises(
        UnsupportedCheckpoint, match=rf"mxfp4: {path}\.down_proj_scales is torch.uint8 \(4, 64, 1\)"
    ):
        load_mxfp4_experts(model, halved, config, torch.device("cpu"))
    assert load_mxfp4_experts(model, dict(parts), config, torch.device("cpu")) == 1
    assert isinstance(model.get_submodule(path), Mxfp4Experts)


def _block_fp8_moe(tmp_path: Path, layer: str) -> Path:
    """A tiny Qwen3-MoE folder in block FP8 holding one quantized layer at ``layer``, as the
    Qwen3-30B-A3B-FP8 release names each expert's layers (``experts.0.gate_proj``)."""
    from safetensors.torch import save_file

    from tests.tiny_families import tiny_config

    config = tiny_config("qwen3_moe").to_dict()
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "quantization_config": {**FP8_BLOCKS, "weight_block_size": [32, 32]}})
    )
    weight = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    tensors = {f"{layer}.weight": weight, f"{layer}.weight_scale_inv": torch.ones(1, 2)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize(
    ("layer", "named"),
    [
        (
            "model.layers.0.mlp.experts.0.gate_proj",
            r"per-expert quantized weights of an MoE block \(model\.layers\.0\.mlp\.experts\.0\.gate_proj\)",
        ),
        ("model.layers.0.mlp.dense.up_proj", r"model\.layers\.0\.mlp\.dense\.up_proj is no linear layer"),
    ],
)
def test_a_quantized_layer_the_model_does_not_have_is_refused_by_name(
    tmp_path: Path, layer: str, named: str
) -> None:
    with pytest.raises(
        ModelLoadError, match=r"fp8 block-wise 32x32 \(quant_method fp8\): " + named
    ) as refused:
        load_model(str(_block_fp8_moe(tmp_path, layer)), device="cpu", quantization="auto")
    assert "\n" not in str(refused.value) and refused.value.param == "quantization"
