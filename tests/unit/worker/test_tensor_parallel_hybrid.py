"""Tensor parallelism for the hybrid families (worker/parallel/hybrid.py) without processes: the
shards of tiny random Qwen3.5, Qwen3.5-MoE, Qwen3-Next (Gated DeltaNet, shared experts), Granite 4,
Nemotron-H, Falcon-H1 (Mamba-2: B/C groups split or replicated, a gated norm group spanning ranks)
and LFM2 (short convs) give the whole model's logits, prompt and greedy decode through the mixers'
states; each rank keeps its heads' states; counts that do not divide are refused in one line."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tests.tiny_families import tiny_config, tiny_model
from tests.unit.worker.test_tensor_parallel import PROMPT, ThreadSum, biased_model, sharded_logits
from tests.unit.worker.test_tensor_parallel_quantized import IDS, load, logits_of, rank_models, relative_error
from worker.model.loader import ModelLoadError
from worker.model.recurrent import find_mixers, state_shapes
from worker.parallel import hybrid
from worker.parallel.sharding import Shard, check_shardable, shard_model

# Granite 4's tiny Mamba-2 layers: 8 heads of 16 (128 channels), one B/C group unless changed.
GRANITE_GROUPS = {"mamba_n_groups": 4}
NEMOTRON_MOE = {
    "layers_block_type": ["mamba", "attention", "moe", "mamba"],
    "moe_shared_expert_intermediate_size": 64,
    "moe_intermediate_size": 32,
}


@pytest.mark.parametrize(
    ("family", "ranks", "changes"),
    [
        ("qwen3_5_text", 2, {}),  # 2 key heads, 4 value heads: one key head per rank
        ("qwen3_5_text", 4, {}),  # each key head replicated on the two ranks of its value heads
        ("qwen3_5_moe_text", 2, {}),  # a shared expert and its gate
        ("qwen3_next", 2, {}),  # q/k/v/z and b/a interleaved per key head
        ("qwen3_next", 4, {}),
        ("granitemoehybrid", 2, {}),  # one group: B/C replicated, the gated norm's group spans ranks
        ("granitemoehybrid", 4, {"mamba_n_groups": 2}),  # each group over two ranks
        ("granitemoehybrid", 2, GRANITE_GROUPS),  # two whole groups per rank
        ("nemotron_h", 2, {}),  # one-part blocks: Mamba-2, attention, a non-gated MLP
        ("nemotron_h", 4, {"n_groups": 2}),
        ("nemotron_h", 2, NEMOTRON_MOE),  # non-gated experts, shared experts
        ("nemotron_h", 2, {**NEMOTRON_MOE, "moe_latent_size": 32, "mlp_bias": True}),  # latent MoE
        ("falcon_h1", 2, {"ssm_multipliers": [0.5, 2.0, 0.7, 1.3, 0.9]}),  # attention and Mamba side by side
        ("falcon_h1", 4, {"mamba_rms_norm": True, "mamba_n_groups": 2}),  # its gated norm, spanning
        ("falcon_h1", 2, {"mamba_rms_norm": True, "mamba_norm_before_gate": True}),
        ("lfm2", 2, {}),  # short convs, attention's out_proj, w1/w3/w2
        ("lfm2", 4, {"intermediate_size": 96}),
        ("granitemoe", 2, {}),  # not hybrid: Granite's block_sparse_moe in place of an mlp
        ("glm4_moe", 2, {}),  # not hybrid: an MoE block's gated shared experts (a dense first layer)
    ],
)
def test_every_rank_of_a_sharded_hybrid_computes_the_whole_models_logits(
    family: str, ranks: int, changes: dict[str, Any]
) -> None:
    whole_model = biased_model(family, **changes)
    whole_model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        whole = whole_model(input_ids=PROMPT).logits[0]
    sharded = sharded_logits(family, ranks, "sdpa", **changes)
    assert len(sharded) == ranks
    for logits in sharded:
        torch.testing.assert_close(logits, whole, atol=1e-4, rtol=0)


def sharded_generate(family: str, ranks: int, tokens: int, **changes: Any) -> list[Any]:
    """Each rank's greedy ``generate`` of :data:`PROMPT` (transformers' cache: the mixers' decode
    path over their conv and recurrent states), its shard run in a thread."""
    summing = ThreadSum(ranks)
    models = []
    for rank in range(ranks):
        model = biased_model(family, **changes)
        shard_model(model, Shard(rank, ranks, summing.of(rank)))
        models.append(model)
    results: list[Any] = [None] * ranks

    def run(rank: int) -> None:
        with torch.inference_mode():
            results[rank] = models[rank].generate(
                PROMPT,
                max_new_tokens=tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.parametrize(
    ("family", "changes"),
    [
        ("qwen3_5_text", {}),
        ("granitemoehybrid", {}),
        ("nemotron_h", {}),
        ("falcon_h1", {"mamba_rms_norm": True}),
        ("lfm2", {}),
    ],
)
def test_sharded_hybrids_decode_the_whole_models_greedy_tokens_through_their_states(
    family: str, changes: dict[str, Any]
) -> None:
    whole = biased_model(family, **changes)
    with torch.inference_mode():
        expected = whole.generate(
            PROMPT, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    for got in sharded_generate(family, 2, 6, **changes):
        assert torch.equal(got.sequences, expected.sequences)
        for step, want in zip(got.logits, expected.logits, strict=True):
            torch.testing.assert_close(step, want, atol=1e-4, rtol=0)


def test_a_hybrid_shard_holds_its_heads_and_their_state_only() -> None:
    qwen = tiny_model(tiny_config("qwen3_5_text"))  # key heads 2 x 16, value heads 4 x 16
    mixer = qwen.model.layers[0].linear_attn
    qkv, conv, a_log = (
        t.detach().clone() for t in (mixer.in_proj_qkv.weight, mixer.conv1d.weight, mixer.A_log)
    )
    whole_shapes = state_shapes(find_mixers(qwen), 64, torch.device("cpu"), torch.float32)
    shard_model(qwen, Shard(1, 2, lambda tensor: None))
    mixer = qwen.model.layers[0].linear_attn
    rows = [*range(16, 32), *range(48, 64), *range(96, 128)]  # q and k of key head 1, v heads 2-3
    assert torch.equal(mixer.in_proj_qkv.weight, qkv[rows]) and torch.equal(mixer.conv1d.weight, conv[rows])
    assert torch.equal(mixer.A_log, a_log[2:]) and mixer.out_proj.part.in_features == 32
    assert (mixer.num_k_heads, mixer.num_v_heads, mixer.conv_dim) == (1, 2, 64)
    shapes = state_shapes(find_mixers(qwen), 64, torch.device("cpu"), torch.float32)
    assert {layer: shape.bytes * 2 for layer, shape in shapes.items()} == {
        layer: shape.bytes for layer, shape in whole_shapes.items()
    }
    granite = tiny_model(tiny_config("granitemoehybrid", **GRANITE_GROUPS))  # 8 heads, 4 groups of 16
    mamba = granite.model.layers[0].mamba
    projection = mamba.in_proj.weight.detach().clone()
    shard_model(granite, Shard(1, 2, lambda tensor: None))
    mamba = granite.model.layers[0].mamba
    # [gate 128 | x 128 | B 4x16 | C 4x16 | dt 8]: heads 4-7's gate, x and dt, groups 2-3's B and C
    kept = [*range(64, 128), *range(192, 256), *range(288, 320), *range(352, 384), *range(388, 392)]
    assert torch.equal(mamba.in_proj.weight, projection[kept])
    assert (mamba.num_heads, mamba.n_groups, mamba.conv_dim) == (4, 2, 128)
    state = state_shapes({0: mamba}, 64, torch.device("cpu"), torch.float32)[0]
    assert state.conv == (128, 4) and state.recurrent == (4, 16, 16)


@pytest.mark.parametrize(
    ("family", "changes", "ranks", "message"),
    [
        (
            "qwen3_5_text",
            {"linear_num_key_heads": 3, "linear_num_value_heads": 6},
            2,
            "--tensor-parallel-size 2: qwen3_5_text has 3 linear-attention key heads, which do not "
            "divide by 2",
        ),
        (
            "granitemoehybrid",
            {"mamba_n_heads": 6, "mamba_d_head": 32, "mamba_expand": 3, "mamba_n_groups": 3},
            2,
            "--tensor-parallel-size 2: granitemoehybrid has 3 B/C groups, which do not divide by 2",
        ),
        (
            "granitemoehybrid",
            {"mamba_n_heads": 2, "mamba_d_head": 64},
            4,
            "--tensor-parallel-size 4: granitemoehybrid has 2 Mamba heads, which do not divide by 4",
        ),
        (
            "lfm2",
            {"hidden_size": 60, "num_attention_heads": 4, "head_dim": 16},
            8,
            "--tensor-parallel-size 8: lfm2 has 4 attention heads and 60 short-convolution channels",
        ),
    ],
)
def test_hybrid_sharding_errors_are_refused_in_one_line_naming_them(
    family: str, changes: dict[str, Any], ranks: int, message: str
) -> None:
    model = tiny_model(tiny_config(family, **changes))
    with pytest.raises(ModelLoadError) as refused:
        check_shardable(model, ranks)
    assert refused.value.message.startswith(message) and "\n" not in refused.value.message


def test_a_cut_through_int4_groups_of_a_mixers_out_proj_is_refused_naming_it() -> None:
    # Four ranks give the Gated DeltaNet's out_proj 16 of its 64 inputs each: half a group of 32.
    with pytest.raises(ModelLoadError) as refused:
        check_shardable(tiny_model(tiny_config("qwen3_5_text")), 4, "int4")
    assert refused.value.message == (
        "--tensor-parallel-size 4: qwen3_5_text: --quantization int4's groups of 32 would straddle the "
        "ranks' cut of out_proj (16 inputs per rank) and down_proj (16 inputs per rank); use int8 or "
        "fewer ranks"
    )
    check_shardable(tiny_model(tiny_config("qwen3_5_text")), 2, "int4")  # 32 inputs each: whole groups


def test_a_recurrent_mixer_of_a_form_not_sharded_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every mixer the worker serves is sharded; one added to recurrent.MIXERS before hybrid.py learns
    # its layout is refused by name rather than cut as something else.
    monkeypatch.setattr(hybrid, "SHARDED", hybrid.SHARDED - {"Lfm2ShortConv"})
    with pytest.raises(ModelLoadError) as refused:
        check_shardable(tiny_model(tiny_config("lfm2")), 2)
    assert refused.value.message == (
        "--tensor-parallel-size 2: lfm2: its recurrent mixers (Lfm2ShortConv) are not sharded yet"
    )


def test_a_shared_expert_that_is_not_a_dense_mlp_is_still_refused() -> None:
    model = tiny_model(tiny_config("qwen3_5_moe_text"))
    model.model.layers[1].mlp.shared_expert = torch.nn.Linear(64, 64)
    with pytest.raises(ModelLoadError) as refused:
        check_shardable(model, 2)
    assert refused.value.message == (
        "--tensor-parallel-size 2: qwen3_5_moe_text: layer 1's MoE block has "
        "shared_expert/shared_expert_gate; not supported yet"
    )


def quiet_checkpoint(folder: Path, family: str, tokenizer_dir: Path) -> Path:
    """The family's tiny model saved with transformers' usual initializer range (0.02: the tiny
    families' 0.2 makes a recurrent model carry a rounding difference far past the quantization's
    own error) and the tokenizer of ``tokenizer_dir``."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    extra = {"shared_intermediate_size": 128} if family == "granitemoehybrid" else {}
    config = tiny_config(family, vocab_size=len(tokenizer), initializer_range=0.02, **extra)
    model = tiny_model(config)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_two_ranks_of_a_quantized_hybrid_compute_the_quantized_models_logits(
    tiny_hybrid_dir: Path, tmp_path: Path, family: str, scheme: str
) -> None:
    # The mixers' projections are quantized after the cut as the attention's are. The ranks' logits
    # are as close to the whole quantized model's as those are to the float model's: int8's
    # row-parallel shards scale their own half-rows, and bfloat16 partial sums differ (measured:
    # Granite's int8 1.5% of the largest logit against its quantization's 2.3%, int4 0.9% against
    # 14%; Qwen3.5's 0.6% against 0.7% and 0.5% against 4%).
    folder = quiet_checkpoint(tmp_path, family, tiny_hybrid_dir)
    plain, whole = load(folder, "none"), load(folder, scheme)
    ranks, _ = rank_models(folder, scheme, 2)
    mixer = next(iter(find_mixers(ranks[1].model).values()))
    assert not isinstance(mixer.out_proj.part, torch.nn.Linear)
    with torch.inference_mode():
        expected, floats = whole.model(input_ids=IDS).logits[0], plain.model(input_ids=IDS).logits[0]
    bound = relative_error(expected, floats)
    for logits in logits_of(ranks):
        assert relative_error(logits, expected) <= bound
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
