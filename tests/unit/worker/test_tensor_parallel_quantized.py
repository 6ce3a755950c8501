"""``--tensor-parallel-size N --quantization int8|int4``: each rank cuts the float weights into its
shards and only then quantizes them (ranks as threads over the session's tiny llama): a rank holds
its share of the quantized bytes, a shard's codes are the whole layer's where int4's groups do not
straddle the cut, the ranks' logits equal the unsharded quantized model's within the
quantization's own error, and a cut through int4's groups is refused in one line. Rank 0 alone
reads the tokenizer; every rank builds and warms its runner with rank 0's context length."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.unit.worker.test_tensor_parallel import ThreadSum
from worker.config import parse_config
from worker.model.loader import LoadedModel, ModelLoadError, load_model
from worker.parallel import ranks as ranks_module
from worker.parallel.group import Layout
from worker.parallel.ranks import sharded_runner
from worker.parallel.sharding import Shard, shard_model
from worker.quant.layers import Int4Linear, Int8Linear, weight_bytes

IDS = torch.tensor([[1, 42, 7, 99, 3, 250, 18, 4000, 61]])


def load(folder: Path, scheme: str, shard: Any = None) -> LoadedModel:
    return load_model(str(folder), device="cpu", dtype="float32", quantization=scheme, shard=shard)


def rank_models(folder: Path, scheme: str, ranks: int) -> tuple[list[LoadedModel], ThreadSum]:
    """Each rank's model as the worker's ranks load it: the float model cut, then quantized."""
    summing = ThreadSum(ranks)
    loaded = [
        load(folder, scheme, lambda model, r=rank: shard_model(model, Shard(r, ranks, summing.of(r)), scheme))
        for rank in range(ranks)
    ]
    return loaded, summing


def logits_of(models: list[LoadedModel]) -> list[torch.Tensor]:
    """Every rank's logits for :data:`IDS`, the ranks run as threads."""
    results: list[torch.Tensor | None] = [None] * len(models)

    def run(rank: int) -> None:
        with torch.inference_mode():
            results[rank] = models[rank].model(input_ids=IDS).logits[0]

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [logits for logits in results if logits is not None]


def layer_bytes(loaded: LoadedModel) -> int:
    return sum(weight_bytes(layer) for layer in loaded.model.model.layers)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_two_ranks_quantize_their_own_shards_and_compute_the_quantized_models_logits(
    tiny_model_dir: Path, scheme: str
) -> None:
    plain = load(tiny_model_dir, "none")
    whole = load(tiny_model_dir, scheme)
    ranks, _ = rank_models(tiny_model_dir, scheme, 2)
    kinds = (Int8Linear,) if scheme == "int8" else (Int4Linear,)
    for loaded in ranks:
        assert loaded.quantization == scheme
        attention, mlp = loaded.model.model.layers[0].self_attn, loaded.model.model.layers[0].mlp
        assert isinstance(attention.q_proj, kinds) and isinstance(mlp.down_proj.part, kinds)
        head = loaded.model.get_output_embeddings().part  # half the vocabulary, int8 as one rank's
        assert isinstance(head, Int8Linear) and 2 * head.out_features == len(loaded.tokenizer)
        assert not any(isinstance(m, torch.nn.Linear) for m in loaded.model.model.layers.modules())
        assert layer_bytes(loaded) <= layer_bytes(whole) * 0.55  # half, and a row-parallel's scales
    # Column-parallel shards (whole rows) and, for int4, row-parallel ones cut between groups hold
    # the whole layer's codes; int8's row-parallel shards scale their own half-rows.
    for rank, loaded in enumerate(ranks):
        mine, full = loaded.model.model.layers[1], whole.model.model.layers[1]
        rows = slice(32 * rank, 32 * (rank + 1))
        assert torch.equal(mine.self_attn.q_proj.dequantized(), full.self_attn.q_proj.dequantized()[rows])
        if scheme == "int4":
            got, want = mine.mlp.down_proj.part.dequantized(), full.mlp.down_proj.dequantized()
            assert torch.equal(got, want[:, 64 * rank : 64 * (rank + 1)])
    with torch.inference_mode():
        expected, floats = whole.model(input_ids=IDS).logits[0], plain.model(input_ids=IDS).logits[0]
    # The ranks' sum moves a logit by at most the kernels' own rounding (activations and results in
    # bfloat16: 2**-7 of the largest), which is within the quantization's error.
    bound = min(2.0**-7, relative_error(expected, floats))
    for logits in logits_of(ranks):
        assert relative_error(logits, expected) <= bound
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_a_cut_through_int4_groups_is_refused_in_one_line(tiny_model_dir: Path) -> None:
    # Four ranks give o_proj 16 of its 64 inputs each: half a group of 32.
    with pytest.raises(ModelLoadError) as refused:
        rank_models(tiny_model_dir, "int4", 4)
    assert refused.value.message == (
        "--tensor-parallel-size 4: llama: --quantization int4's groups of 32 would straddle the ranks' "
        "cut of o_proj (16 inputs per rank); use int8 or fewer ranks"
    )
    loaded, _ = rank_models(tiny_model_dir, "int8", 4)  # int8's scales are per row: any cut
    assert loaded[0].model.model.layers[0].self_attn.o_proj.part.in_features == 16


class ThreadGroup:
    """What :func:`sharded_runner` uses of a :class:`~worker.parallel.group.RankGroup`, for ranks
    run as threads: :class:`ThreadSum`'s all-reduce, rank 0's value shared, the pools and graphs
    compared."""

    def __init__(self, rank: int, ranks: int, summing: ThreadSum, shared: list[Any], met: threading.Barrier):
        self.layout = Layout(rank, ranks, rank, "")
        self.all_reduce = summing.of(rank)
        self._shared, self._met = shared, met

    def share(self, value: int) -> int:
        if self.layout.rank == 0:
            self._shared.append(value)
        self._met.wait()
        return int(self._shared[0])

    def agree(self, value: int, what: str) -> None:
        self._shared.append((what, value))

    def all_of(self, value: bool, what: str) -> bool:
        self._shared.append((what, value))
        return value


def test_only_rank_zero_reads_the_tokenizer_and_every_rank_warms_up_with_its_context_length(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower's load reads no tokenizer (seconds per rank for a 262k vocabulary) and no
    processor; the tokenizer's ``model_max_length`` (lowered here to 96) is rank 0's to read, and
    every rank takes it: their warm-ups run the same forwards together, and their runners match."""
    reads: list[str] = []
    read = transformers.AutoTokenizer.from_pretrained

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(threading.current_thread().name)
        tokenizer = read(*args, **kwargs)
        tokenizer.model_max_length = 96
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    loading, load = threading.Lock(), ranks_module.load_configured

    def one_at_a_time(*args: Any, **kwargs: Any) -> Any:  # transformers' meta-device init is global
        with loading:
            return load(*args, **kwargs)

    monkeypatch.setattr(ranks_module, "load_configured", one_at_a_time)
    config = parse_config(
        ["--model", str(tiny_model_dir), "-tp", "2", "--device", "cpu", "--max-batch-tokens", "512"], {}
    )
    summing, shared, met = ThreadSum(2), [], threading.Barrier(2, timeout=60)
    results: dict[int, Any] = {}

    def rank(number: int) -> None:
        results[number] = sharded_runner(config, ThreadGroup(number, 2, summing, shared, met))  # type: ignore[arg-type]

    threads = [threading.Thread(target=rank, args=(number,), name=f"rank{number}") for number in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == [0, 1], "a rank failed (its traceback above)"
    (lead, lead_runner, _), (follower, follower_runner, _) = results[0], results[1]
    assert reads == ["rank0"]
    assert lead.tokenizer is not None and follower.tokenizer is None and follower.processor is None
    assert lead.context_length == follower.context_length == 96
    assert sorted(shared[1:], key=str) == sorted(
        [("the KV pool's blocks", lead_runner.num_blocks)] * 2 + [("captured decode graphs", False)] * 2,
        key=str,
    )
    assert follower_runner.num_blocks == lead_runner.num_blocks
