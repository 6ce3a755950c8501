"""Pre-quantized checkpoints (tools/quant_fixtures.py's, made by the real tools) under
``--tensor-parallel-size``, ranks as threads: each rank's layers are cut as they are read
(worker/parallel/quantized_shards.py), so a shard's weight is the whole layer's slice bit for bit
(column-parallel: its rows; row-parallel: its inputs, between the format's groups), and the ranks'
logits equal the unsharded quantized model's within the kernels' rounding (MXFP4 experts: cut on
their packed blocks); a cut through a format's groups is refused in one line naming it."""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.quant_checkpoints import quant_checkpoint
from tests.unit.worker.test_tensor_parallel import ThreadSum
from tools.quant_fixtures import PROMPT
from worker.model.loader import LoadedModel, ModelLoadError, load_model
from worker.parallel.quantized_shards import QuantizedShards, WholeRowScale
from worker.parallel.sharding import Shard, shard_model
from worker.quant.act_order import ActOrderInt4Linear, group_order
from worker.quant.checkpoint_loading import _int4_layer
from worker.quant.layers import Fp8Linear, Int4Linear
from worker.quant.mxfp4 import Mxfp4Experts

IDS = torch.tensor([PROMPT])
INT4 = ("w4a16", "w4a16_asym", "gptq", "awq")
FP8 = ("fp8_dynamic", "fp8_block", "fp8_block_ct")
# The most a logit moves against the unsharded model's, over its largest: int4's CPU products round
# activations and results to bfloat16 (2**-8 each; measured 2.8e-3 to 3.6e-3), as for
# --quantization int4's shards (test_tensor_parallel_quantized.py); fp8's upcast products are
# float32 and round the same inputs (FP8-dynamic's row-parallel shards under the whole row's
# scale), so only the ranks' summation order differs (measured 2.4e-7 to 3.6e-7; 3.2e-2 for
# FP8-dynamic with each rank's own part's scale).
BOUND = {**dict.fromkeys(INT4, 2.0**-7), **dict.fromkeys(FP8, 1e-5)}


def load(folder: Path) -> LoadedModel:
    return load_model(str(folder), device="cpu", quantization="auto")


def rank_models(folder: Path, ranks: int) -> list[LoadedModel]:
    """Each rank's model as a worker's rank loads it: its share of each quantized layer cut as it
    is read, then the float layers (embedding, output layer) cut and the shards wired to sum."""
    summing = ThreadSum(ranks)
    return [
        load_model(
            str(folder),
            device="cpu",
            quantization="auto",
            shard=lambda model, r=rank: shard_model(model, Shard(r, ranks, summing.of(r))),
            slicer=functools.partial(QuantizedShards, rank, ranks),
        )
        for rank in range(ranks)
    ]


def logits_of(models: list[LoadedModel]) -> list[torch.Tensor]:
    results: list[torch.Tensor | None] = [None] * len(models)

    def run(rank: int) -> None:
        with torch.inference_mode():
            results[rank] = models[rank].model(input_ids=IDS).logits[0].float()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [logits for logits in results if logits is not None]


def own(part: torch.nn.Module) -> torch.nn.Module:
    """A row-parallel shard's quantized layer (FP8-dynamic's inside :class:`WholeRowScale`)."""
    return part.layer if isinstance(part, WholeRowScale) else part


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("name", [*INT4, *FP8])
def test_two_ranks_hold_the_checkpoints_own_slices_and_compute_its_logits(name: str) -> None:
    folder = quant_checkpoint(name)
    whole = load(folder)
    ranks = rank_models(folder, 2)
    kind = Int4Linear if name in INT4 else Fp8Linear
    for rank, loaded in enumerate(ranks):
        assert loaded.quantization == whole.quantization
        for index, layer in enumerate(loaded.model.model.layers):
            full = whole.model.model.layers[index]
            attention, mlp = layer.self_attn, layer.mlp
            assert type(attention.q_proj) is type(full.self_attn.q_proj) and isinstance(
                attention.q_proj, kind
            )
            assert type(own(mlp.down_proj.part)) is type(full.mlp.down_proj)
            # Column-parallel: this rank's query heads (2 of 4, 16 wide) and KV head (1 of 2), its
            # half of the MLP width; row-parallel: its half of the inputs. The whole layer's values.
            for got, want, rows in (
                (attention.q_proj, full.self_attn.q_proj, slice(32 * rank, 32 * rank + 32)),
                (attention.k_proj, full.self_attn.k_proj, slice(16 * rank, 16 * rank + 16)),
                (mlp.up_proj, full.mlp.up_proj, slice(32 * rank, 32 * rank + 32)),
            ):
                assert torch.equal(got.dequantized(), want.dequantized()[rows])
            columns = slice(32 * rank, 32 * rank + 32)
            for got, want in (
                (own(attention.o_proj.part), full.self_attn.o_proj),
                (own(mlp.down_proj.part), full.mlp.down_proj),
            ):
                assert torch.equal(got.dequantized(), want.dequantized()[:, columns])
            assert (mlp.down_proj.part is own(mlp.down_proj.part)) == (name != "fp8_dynamic")
    expected = logits_of([whole])[0]
    sharded = logits_of(ranks)
    errors = [relative_error(logits, expected) for logits in sharded]
    print(f"{name}: the ranks' logits against one rank's, largest relative difference {max(errors):.2e}")
    for logits, error in zip(sharded, errors, strict=True):
        assert error <= BOUND[name]
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_act_order_shards_hold_their_share_of_the_groups_and_read_the_whole_input() -> None:
    """gptqmodel's act-order orders each layer's inputs by their importance, so a row-parallel
    rank's half of the inputs would hold parts of most groups: each rank keeps half the groups
    instead (their codes, scales and zeros: the whole layer's), reading the whole input, gathered
    from the ranks (exact: one rank's value plus zeros). The ranks' weights add up to the whole
    layer's, each zero off its groups' inputs; the logits are one rank's within int4's rounding."""
    folder = quant_checkpoint("gptq_act_order")
    whole = load(folder)
    ranks = rank_models(folder, 2)
    for index, full in enumerate(whole.model.model.layers):
        for name, want in (("o_proj", full.self_attn.o_proj), ("down_proj", full.mlp.down_proj)):
            parts = [
                getattr(loaded.model.model.layers[index], "self_attn" if name == "o_proj" else "mlp")
                for loaded in ranks
            ]
            got = [getattr(part, name).part for part in parts]
            assert all(isinstance(layer, ActOrderInt4Linear) and layer.in_features == 32 for layer in got)
            weights = [layer.dequantized() for layer in got]
            assert torch.equal(weights[0] + weights[1], want.dequantized())
            assert not bool(((weights[0] != 0) & (weights[1] != 0)).any())
    expected = logits_of([whole])[0]
    for logits in logits_of(ranks):
        print(
            f"gptq_act_order: the ranks' logits within {relative_error(logits, expected):.1e} of one rank's"
        )
        assert relative_error(logits, expected) <= 2.0**-7
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_an_act_order_layer_whose_groups_fall_whole_on_each_rank_is_cut_exactly() -> None:
    """An act-order row-parallel cut whose every rank holds whole groups (here groups 3 and 1 in
    the first half of the inputs, 0 and 2 in the second, each shuffled): each rank keeps those
    groups' scales and zeros renumbered, its inputs still gathered in group order, and its weight
    is the whole layer's columns bit for bit."""
    generator = torch.Generator().manual_seed(0)
    group, outputs = 32, 16
    halves = [torch.tensor([3, 1]).repeat_interleave(group), torch.tensor([0, 2]).repeat_interleave(group)]
    g_idx = torch.cat([half[torch.randperm(2 * group, generator=generator)] for half in halves]).int()
    q = torch.randint(0, 16, (outputs, 4 * group), generator=generator, dtype=torch.int32)
    scale = torch.rand(4, outputs, generator=generator) + 0.1
    zero = torch.randn(4, outputs, generator=generator)
    whole = _int4_layer(q, scale, zero, group, "whole", group_order(g_idx, group, "whole"))
    assert isinstance(whole, ActOrderInt4Linear)
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=4)
    for rank in range(2):
        cut = QuantizedShards(rank, 2, config).int4(
            "model.layers.0.mlp.down_proj", q, scale, zero, g_idx, group
        )
        mine_q, mine_scale, mine_zero, mine_idx = cut
        assert mine_idx is not None and sorted(set(mine_idx.tolist())) == [0, 1]
        part = _int4_layer(mine_q, mine_scale, mine_zero, group, "part", group_order(mine_idx, group, "part"))
        assert isinstance(part, ActOrderInt4Linear)
        assert torch.equal(
            part.dequantized(), whole.dequantized()[:, 2 * group * rank : 2 * group * (rank + 1)]
        )


@pytest.mark.parametrize(
    ("name", "refusal"),
    [
        ("gptq", r"its int4 groups of 32 inputs straddle the 4 ranks' cut \(16 inputs per rank\)"),
        ("fp8_block", r"its fp8 tiles of 32x32 \(input groups of a row\) straddle the 4 ranks' cut"),
    ],
)
def test_a_cut_through_a_formats_groups_is_refused_in_one_line(name: str, refusal: str) -> None:
    with pytest.raises(ModelLoadError) as refused:
        rank_models(quant_checkpoint(name), 4)  # o_proj's and down_proj's 64 inputs: 16 a rank
    message = refused.value.message
    assert "\n" not in message and re.search(rf"(o_proj|down_proj): {refusal}", message), message


def test_mxfp4_experts_are_cut_on_their_packed_blocks() -> None:
    """A tiny gpt-oss's MXFP4 experts (4 experts, an intermediate width of 64) at two ranks: every
    expert's gate/up rows of this rank's 32 intermediate columns (interleaved pairs) and its
    down_proj inputs (one block of 32), the whole expert's values bit for bit; the logits those of
    one rank within float32 summation order."""
    folder = quant_checkpoint("mxfp4")
    whole = load(folder)
    ranks = rank_models(folder, 2)
    for rank, loaded in enumerate(ranks):
        for mine, full in zip(loaded.model.model.layers, whole.model.model.layers, strict=True):
            assert isinstance(mine.mlp.experts, Mxfp4Experts)
            for expert in range(4):
                got, want = (
                    e.weight("gate_up_proj", expert, torch.float32)
                    for e in (mine.mlp.experts, full.mlp.experts)
                )
                assert torch.equal(got, want[64 * rank : 64 * (rank + 1)])
                got, want = (
                    e.weight("down_proj", expert, torch.float32) for e in (mine.mlp.experts, full.mlp.experts)
                )
                assert torch.equal(got, want[:, 32 * rank : 32 * (rank + 1)])
    expected = logits_of([whole])[0]
    for logits in logits_of(ranks):
        print(f"mxfp4: the ranks' logits within {relative_error(logits, expected):.1e} of one rank's")
        assert relative_error(logits, expected) <= 1e-5
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_mxfp4_experts_cut_through_their_blocks_are_refused_by_name() -> None:
    with pytest.raises(ModelLoadError) as refused:
        rank_models(quant_checkpoint("mxfp4"), 4)  # 16 of the 64 intermediate columns a rank: half a block
    assert refused.value.message == (
        "--tensor-parallel-size 4: gpt_oss: layer 0's MXFP4 experts: down_proj's blocks of 32 inputs "
        "would straddle the ranks' cut (16 inputs per rank); use fewer ranks"
    )


@pytest.mark.slow  # two loads of the default model (about 40 s on two cores)
def test_a_gguf_files_4_bit_blocks_are_cut_as_read_not_quantized_again() -> None:
    """The default model (a Q4_1 GGUF, 9 attention and 3 KV heads) with ``--quantization int4`` in
    float32, rank 1 of 3: every decoder projection holds the file's 4-bit values (the whole
    layer's slice bit for bit), the embedding and output layer one rank's int8 table, whole.
    Before, a rank dequantized the file, cut the floats and quantized them again: Q4_1's min-max
    blocks came back with the same codes (by luck of the format: Q4_0's would not), but the
    embedding was float and the head's slice requantized, so this test failed on the head.
    Measured at three ranks against one: logits within 1.7e-2 of the largest (2.9e-2 before;
    the int4 kernel rounds each part's result to bfloat16, over 30 layers)."""
    whole = load_model(None, device="cpu", dtype="float32", quantization="int4").model
    rank = load_model(
        None,
        device="cpu",
        dtype="float32",
        quantization="int4",
        tokenizer=False,
        shard=lambda model: shard_model(model, Shard(1, 3, lambda tensor: None)),
        slicer=functools.partial(QuantizedShards, 1, 3),
    ).model
    for index in (0, 14, 29):  # three of the 30 layers: reading a layer back takes a product
        mine, full = rank.model.layers[index], whole.model.layers[index]
        attention, mlp = mine.self_attn, mine.mlp
        for got, want, rows in (
            (attention.q_proj, full.self_attn.q_proj, slice(192, 384)),  # query heads 3..5
            (attention.k_proj, full.self_attn.k_proj, slice(64, 128)),  # KV head 1
            (attention.v_proj, full.self_attn.v_proj, slice(64, 128)),
            (mlp.gate_proj, full.mlp.gate_proj, slice(512, 1024)),
        ):
            assert isinstance(got, Int4Linear) and torch.equal(got.dequantized(), want.dequantized()[rows])
        for got, want, columns in (
            (attention.o_proj.part, full.self_attn.o_proj, slice(192, 384)),
            (mlp.down_proj.part, full.mlp.down_proj, slice(512, 1024)),
        ):
            assert isinstance(got, Int4Linear) and torch.equal(
                got.dequantized(), want.dequantized()[:, columns]
            )
    assert type(rank.get_output_embeddings()) is type(whole.get_output_embeddings())  # whole: int8


def test_heads_that_do_not_split_are_refused_by_the_sharding_naming_them() -> None:
    with pytest.raises(ModelLoadError) as refused:
        rank_models(quant_checkpoint("gptq"), 3)  # 4 attention heads, 2 KV heads
    assert refused.value.message == (
        "--tensor-parallel-size 3: llama has 4 attention heads and 2 KV heads, which do not divide by 3"
    )


def test_adapters_over_a_cut_pre_quantized_checkpoint_are_refused_in_one_line() -> None:
    """LoRA's wrapped layers take their share of an adapter by the float shards' cuts, which a
    pre-quantized layer cut as read does not record: refused at load naming both settings."""
    from worker.config import parse_config
    from worker.model.loader import ModelLoadError
    from worker.parallel.ranks import sharded_runner

    folder = quant_checkpoint("gptq")
    config = parse_config(["--model", str(folder), "-tp", "2", "--enable-lora"], environ={})
    with pytest.raises(
        ModelLoadError, match=r"--enable-lora with --tensor-parallel-size 2: .* pre-quantized"
    ):
        sharded_runner(config, None)  # type: ignore[arg-type]  # refused before the group is used
