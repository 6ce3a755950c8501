"""Tensor parallelism's pieces without processes: the shards of tiny random llama, qwen3, qwen3_moe,
gemma3 (windows, q/k norms) and gpt-oss (sinks, biases, MoE) models (ranks as threads, the
all-reduce a barrier's sum) equal the whole model, sharding errors are refused naming them, ranks
join only once all are there, each rank's KV share, the settings refused with it, and a follower's
exit or a failed collective reported as a rank failure."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.tiny_families import tiny_config, tiny_model
from worker.attention.kv_pool import kv_shape
from worker.config import WorkerConfig, parse_config
from worker.model.device import RankFailure, is_fatal_device_error
from worker.model.loader import ModelLoadError
from worker.model.step_inputs import Work
from worker.parallel import group as group_module
from worker.parallel.group import Execute, Layout, RankGroup, Relay, Score
from worker.parallel.ranks import Followers, node_ranks
from worker.parallel.sharding import Shard, check_shardable, shard_model

PROMPT = torch.tensor([[3, 17, 90, 4, 55, 21, 8, 101, 64, 2, 33]])


class ThreadSum:
    """The ranks' all-reduce for ranks run as threads: every rank's part, summed in rank order."""

    def __init__(self, ranks: int):
        self._parts: list[torch.Tensor | None] = [None] * ranks
        self._barrier = threading.Barrier(ranks)

    def of(self, rank: int) -> Any:
        def all_reduce(tensor: torch.Tensor) -> None:
            self._parts[rank] = tensor.clone()
            self._barrier.wait()
            total = sum(part for part in self._parts if part is not None)
            self._barrier.wait()
            tensor.copy_(total)

        return all_reduce


def biased_model(family: str, **changes: Any) -> Any:
    """The family's tiny model with random biases (transformers starts them at zero, which would
    hide a bias added on every rank instead of one)."""
    model = tiny_model(tiny_config(family, **changes))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model


def sharded_logits(family: str, ranks: int, attention: str, **changes: Any) -> list[torch.Tensor]:
    """Each rank's logits for :data:`PROMPT`, its shard of the family's tiny model run in a thread."""
    summing = ThreadSum(ranks)
    models = []
    for rank in range(ranks):
        model = biased_model(family, **changes)
        model.set_attn_implementation(attention)
        shard_model(model, Shard(rank, ranks, summing.of(rank)))
        models.append(model)
    results: list[torch.Tensor | None] = [None] * ranks

    def run(rank: int) -> None:
        with torch.inference_mode():
            results[rank] = models[rank](input_ids=PROMPT).logits[0]

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [logits for logits in results if logits is not None]


@pytest.mark.parametrize(
    ("family", "ranks", "attention"),
    [
        ("llama", 2, "sdpa"),
        ("llama", 4, "sdpa"),
        ("llama", 4, "eager"),
        ("qwen3", 2, "sdpa"),
        ("qwen3_moe", 2, "sdpa"),
        ("gemma3_text", 2, "sdpa"),
        ("gpt_oss", 2, "eager"),
        ("gpt_oss", 4, "eager"),
    ],
)
def test_every_rank_of_a_sharded_model_computes_the_whole_models_logits(
    family: str, ranks: int, attention: str
) -> None:
    # llama over 4 ranks has 2 KV heads: each is replicated on two ranks (eager attention reads
    # the query heads per KV head from the attention module); gpt-oss over 4 too, a sink per rank.
    whole_model = biased_model(family)
    whole_model.set_attn_implementation(attention)
    with torch.inference_mode():
        whole = whole_model(input_ids=PROMPT).logits[0]
    sharded = sharded_logits(family, ranks, attention)
    assert len(sharded) == ranks
    for logits in sharded:
        torch.testing.assert_close(logits, whole, atol=1e-5, rtol=0)


def test_a_shard_holds_its_heads_and_columns_only() -> None:
    model = tiny_model(tiny_config("llama"))  # 4 heads of 16, 2 KV heads, an MLP of 64
    shard_model(model, Shard(1, 2, lambda tensor: None))
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attention.q_proj.out_features == 2 * 16 and attention.k_proj.out_features == 16
    assert attention.o_proj.part.in_features == 2 * 16 and attention.o_proj.part.bias is None
    assert mlp.gate_proj.out_features == 32 and mlp.down_proj.part.in_features == 32
    assert attention.num_key_value_groups == 2


def test_a_shard_holds_its_slice_of_the_vocabulary_and_an_uneven_one_still_gives_the_logits() -> None:
    model = tiny_model(tiny_config("llama", tie_word_embeddings=True))  # a vocabulary of 128
    table = model.model.embed_tokens.weight.detach().clone()
    shard_model(model, Shard(1, 2, lambda tensor: None))
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert torch.equal(embedding.weight, table[64:]) and head.part.weight is embedding.weight
    assert model(input_ids=PROMPT).logits.shape[-1] == 128  # the whole vocabulary, rows 0..63 zero
    # 130 rows over 4 ranks: 33, 33, 33 and 31 of them.
    whole_model = biased_model("llama", vocab_size=130)
    with torch.inference_mode():
        whole = whole_model(input_ids=PROMPT).logits[0]
    for logits in sharded_logits("llama", 4, "sdpa", vocab_size=130):
        torch.testing.assert_close(logits, whole, atol=1e-5, rtol=0)


def test_an_moe_shard_holds_every_experts_columns_and_its_heads_sinks() -> None:
    qwen = tiny_model(tiny_config("qwen3_moe"))  # 4 experts of width 32, [gate | up] concatenated
    whole = qwen.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    shard_model(qwen, Shard(1, 2, lambda tensor: None))
    experts = qwen.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 32, 64) and experts.down_proj.shape == (4, 64, 16)
    assert torch.equal(experts.gate_up_proj[:, :16], whole[:, 16:32])  # gate columns 16..31
    assert torch.equal(experts.gate_up_proj[:, 16:], whole[:, 48:64])  # up columns 16..31
    oss = tiny_model(tiny_config("gpt_oss"))  # width 64, gate and up interleaved, transposed
    sinks = oss.model.layers[0].self_attn.sinks.detach().clone()
    shard_model(oss, Shard(1, 2, lambda tensor: None))
    attention, experts = oss.model.layers[0].self_attn, oss.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 64, 64) and experts.down_proj.shape == (4, 32, 64)
    assert not experts.down_proj_bias.any()  # rank 0 adds it
    assert torch.equal(attention.sinks, sinks[2:]) and attention.o_proj.part.bias is None


def test_an_moe_block_with_more_than_experts_and_a_router_or_a_layer_not_linear_is_refused() -> None:
    model = tiny_model(tiny_config("qwen3_moe"))
    model.model.layers[1].mlp.shared_expert = torch.nn.Linear(64, 64)
    with pytest.raises(ModelLoadError) as refused:
        check_shardable(model, 2)
    assert refused.value.message == (
        "--tensor-parallel-size 2: qwen3_moe: layer 1's MoE block has shared_expert; not supported yet"
    )
    model.model.layers[0].self_attn.o_proj = torch.nn.Identity()
    with pytest.raises(ModelLoadError) as refused:
        check_shardable(model, 2)
    assert refused.value.message == (
        "--tensor-parallel-size 2: qwen3_moe: layer 0 needs nn.Linear or pre-quantized "
        "q_proj/k_proj/v_proj/o_proj to shard, has Linear/Linear/Linear/Identity (fused projections are "
        "not supported yet)"
    )


@pytest.mark.parametrize(
    ("family", "changes", "ranks", "message"),
    [
        (
            "llama",
            {},
            3,
            "--tensor-parallel-size 3: llama has 4 attention heads and 2 KV heads and an MLP width of 64, "
            "which do not divide by 3",
        ),
        (
            "llama",
            {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8},
            16,
            "8 attention heads",
        ),
        ("qwen3_moe", {"moe_intermediate_size": 30}, 4, "qwen3_moe has an MLP width of 30, which do not"),
        (
            "phi3",
            {},
            2,
            "phi3: layer 0 needs nn.Linear or pre-quantized q_proj/k_proj/v_proj/o_proj to shard, "
            "has NoneType",
        ),
    ],
)
def test_sharding_errors_are_refused_in_one_line_naming_them(
    family: str, changes: dict[str, Any], ranks: int, message: str
) -> None:
    model = tiny_model(tiny_config(family, **changes))
    with pytest.raises(ModelLoadError) as refused:
        check_shardable(model, ranks)
    assert message in refused.value.message and "\n" not in refused.value.message


def test_each_rank_pools_its_share_of_the_kv_heads() -> None:
    shape = kv_shape(tiny_config("llama"), torch.float32)  # 4 heads over 2 KV heads
    assert [(layer.heads, layer.kv_heads) for layer in shape.per_rank(2).layers] == [(2, 1)] * 2
    assert [(layer.heads, layer.kv_heads) for layer in shape.per_rank(4).layers] == [(1, 1)] * 2
    assert shape.per_rank(2).bytes_per_token * 2 == shape.bytes_per_token
    assert shape.per_rank(1) is shape


def test_tensor_parallel_is_a_flag_with_vllms_names_and_refuses_what_it_does_not_serve_yet() -> None:
    assert parse_config(["-tp", "3"], {}).tensor_parallel_size == 3
    assert parse_config(["--tensor-parallel-size", "2"], {}).tensor_parallel_size == 2
    problems = WorkerConfig(tensor_parallel_size=2, enable_lora=True, speculative="ngram").problems()
    assert not [p for p in problems if "--enable-lora" in p]  # LoRA adapters are served sharded
    assert not [p for p in problems if "--speculative" in p]  # the proposer runs on rank 0
    assert not [p for p in WorkerConfig(enable_lora=True).problems() if "tensor-parallel" in p]
    invariant = WorkerConfig(tensor_parallel_size=2, batch_invariant=True).problems()
    assert not [p for p in invariant if "--batch-invariant" in p]  # the ranks' sums in rank order


def test_a_failed_all_reduce_is_a_rank_failure_which_fails_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(tensor: torch.Tensor) -> None:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(group_module.dist, "all_reduce", broken)
    group = RankGroup.__new__(RankGroup)  # no process group: the collective itself is faked
    with pytest.raises(RankFailure, match="all-reduce failed: Connection closed by peer") as failed:
        group.all_reduce(torch.ones(2))
    assert is_fatal_device_error(failed.value)


def test_ranks_join_the_process_group_only_once_every_rank_is_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The process group's own rendezvous waits a collective's timeout: a follower whose start takes
    longer (a fresh interpreter's imports on a busy host) must not fail rank 0's load. Rank 0 runs
    in a thread on a real store; the test plays rank 1, and the group itself is faked."""
    initialized = threading.Event()
    monkeypatch.setattr(group_module.dist, "init_process_group", lambda *args, **kwargs: initialized.set())
    monkeypatch.setattr(group_module.dist, "new_group", lambda *args, **kwargs: None)
    store = group_module.rendezvous_store("127.0.0.1", 0, 2)
    joined = threading.Thread(target=RankGroup, args=(Layout(0, 2, 0, ""), torch.device("cpu"), store))
    joined.start()
    rank_one = group_module.dist.TCPStore("127.0.0.1", store.port, 2, is_master=False)
    rank_one.wait([group_module.joined_key(0)], timedelta(seconds=30))  # rank 0 waits for rank 1
    assert not initialized.is_set()
    rank_one.set(group_module.joined_key(1), "1")
    joined.join()
    assert initialized.is_set()


def test_rank_zero_tells_each_forward_without_its_sequences_and_the_fed_ids_on_the_host() -> None:
    sent: list[object] = []

    class Told(RankGroup):
        def __init__(self) -> None:
            self.layout = Layout(0, 2, 0, "127.0.0.1:1")

        def send(self, message: object) -> None:  # type: ignore[override]
            sent.append(message)

    relay = Relay(Told())
    relay.execute([Work([1, 2], 0, [0], True, seq=object())], torch.tensor([7]))
    relay.score([1, 2, 3], 2)
    execute, score = sent
    assert isinstance(execute, Execute) and execute.work[0].seq is None and execute.work[0].tokens == [1, 2]
    assert execute.fed is not None and execute.fed.device.type == "cpu"
    assert score == Score([1, 2, 3], 2)


def test_a_follower_that_exits_is_reported_once_as_a_rank_failure() -> None:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    failures: list[BaseException] = []
    reported = threading.Event()

    def on_failure(failure: BaseException) -> None:
        failures.append(failure)
        reported.set()

    Followers({1: process}).watch(on_failure)
    assert reported.wait(30)
    assert isinstance(failures[0], RankFailure)
    assert f"tensor-parallel rank 1 (pid {process.pid}) exited with status 7" in str(failures[0])


def test_a_stopped_follower_is_no_failure() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    failures: list[BaseException] = []
    followers = Followers({1: process})
    followers.stop(None)
    followers.watch(failures.append)
    process.wait()
    assert failures == []


def test_nodes_take_sglangs_names_and_refuse_what_cannot_be_laid_out() -> None:
    config = parse_config(
        ["-tp", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "leader:5000"], {}
    )
    assert [layout.rank for layout in node_ranks(config, 1)] == [2, 3]
    assert [layout.local_rank for layout in node_ranks(config, 1)] == [0, 1]
    problems = WorkerConfig(tensor_parallel_size=3, nnodes=2, node_rank=2).problems()
    assert "--tensor-parallel-size 3 does not divide over --nnodes 2" in problems
    assert "--node-rank 2 is not below --nnodes 2" in problems
    assert "--nnodes 2 needs --dist-init-addr host:port (node 0's rendezvous)" in problems
    assert (
        "--node-rank and --dist-init-addr only apply with --nnodes above 1"
        in WorkerConfig(node_rank=1).problems()
    )


class GraphVotes:
    """A rank group faked for :func:`agree_on_graphs`: the other ranks' answers given, this rank's
    appended (rank 0's place in ``layout``)."""

    def __init__(self, others: list[bool]):
        self.others = others
        self.layout = Layout(0, len(others) + 1, 0, "")

    def all_of(self, value: bool, what: str) -> bool:
        return all([value, *self.others])


@pytest.mark.parametrize("mine", [True, False])
def test_every_rank_replays_its_captured_graphs_or_none_does(
    mine: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A replay all-reduces a bucket's padded rows and an eager step its own: ranks that captured
    graphs keep them only where every rank did; a rank left alone with graphs drops them (and says
    so), and --require-cuda-graphs then fails the load naming the setting."""
    from types import SimpleNamespace

    from worker.parallel.ranks import agree_on_graphs
    from worker.types import FastPath

    def runner(graphs: bool) -> Any:
        return SimpleNamespace(
            graphs=object() if graphs else None, fast_path=FastPath(kernel=True, graphs=graphs)
        )

    kept = runner(mine)
    agree_on_graphs(GraphVotes([True, True]), kept, required=False)  # type: ignore[arg-type]
    assert (kept.graphs is not None) == mine and kept.fast_path.graphs == mine
    alone = runner(mine)
    with caplog.at_level("ERROR", logger="worker.parallel.ranks"):
        agree_on_graphs(GraphVotes([True, False]), alone, required=False)  # type: ignore[arg-type]
    assert alone.graphs is None and not alone.fast_path.graphs
    assert ("drops its decode graphs" in caplog.text) == mine
    if mine:
        with pytest.raises(ModelLoadError, match="--require-cuda-graphs"):
            agree_on_graphs(GraphVotes([False]), runner(True), required=True)  # type: ignore[arg-type]
