"""LoRA adapters under tensor parallelism without processes: ranks as threads (the all-reduce a
barrier's sum), rank 0 telling the others each step through its relay, each rank's wrapped shards
serving real peft adapters against the whole wrapped model with the same adapters (logits within
1e-4; rows of two adapters and the base in one batch; slots refilled through evictions), the
adapters' weights told only in the step that fills their slot."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.lora_adapters import ALL_TARGETS, build_adapter
from tests.tiny_families import tiny_config, tiny_model
from tests.unit.worker.test_tensor_parallel import ThreadSum
from worker.lora.adapter import read_adapter
from worker.lora.layers import LoraLayers
from worker.model.step_inputs import Work
from worker.parallel.group import Execute, Layout, Message, RankGroup, Relay, Score
from worker.parallel.sharding import Shard, shard_model
from worker.quant.layers import quantize_linears
from worker.types import LoraHandle

ROWS = torch.tensor(
    [
        [3, 17, 90, 4, 55, 21, 8, 101, 64, 2, 33],
        [9, 1, 44, 70, 12, 5, 88, 19, 27, 60, 7],
        [50, 51, 2, 3, 99, 14, 120, 6, 31, 47, 11],
    ]
)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MAX_LORAS, MAX_RANK = 2, 8
# Each step's rows by adapter (None: the base model); two slots for three adapters, so gamma evicts
# alpha in step 2 and alpha evicts gamma in step 3; step 4 finds both of its adapters held.
STEPS = (("alpha", None, "beta"), ("gamma", "beta", "beta"), ("alpha", None, None), ("beta", "alpha", None))
FILLED = ({"alpha", "beta"}, {"gamma"}, {"alpha"}, set())  # the adapters each step copies into a slot


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """Per family: its tiny random model saved, and three peft adapters over it (an MoE family's
    experts are no LoRA targets: its adapters take the attention projections)."""
    root = tmp_path_factory.mktemp("tp-lora")
    made = {}
    for family in ("llama", "qwen3_moe"):
        base = root / family
        tiny_model(tiny_config(family)).save_pretrained(base)
        moe = family == "qwen3_moe"
        adapters = {
            "alpha": build_adapter(
                base, root / f"{family}-alpha", seed=11, targets=ATTENTION if moe else ALL_TARGETS
            ),
            "beta": build_adapter(
                base,
                root / f"{family}-beta",
                seed=12,
                rank=4,
                targets=("q_proj", "v_proj", "o_proj" if moe else "down_proj"),
            ),
            "gamma": build_adapter(
                base,
                root / f"{family}-gamma",
                seed=13,
                targets=("o_proj", "k_proj") if moe else ("o_proj", "up_proj", "down_proj"),
            ),
        }
        made[family] = (base, adapters)
    return made


def wrapped(base: Path, shard: Shard | None = None) -> tuple[Any, LoraLayers]:
    """The checkpoint's model (this rank's shard of it), its projections wrapped for LoRA."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    if shard is not None:
        shard_model(model, shard)
    return model, LoraLayers(model, MAX_LORAS, MAX_RANK)


def handles(adapters: dict[str, Path], layers: LoraLayers) -> dict[str, LoraHandle]:
    """Each adapter read against ``layers``' targets (a shard's report the whole projections')."""
    return {
        name: LoraHandle(
            name, uid, MAX_LORAS, read_adapter(str(folder), layers.targets, MAX_RANK, torch.float32)
        )
        for uid, (name, folder) in enumerate(adapters.items(), start=1)
    }


def forward(model: Any, layers: LoraLayers, work: list[Work]) -> torch.Tensor:
    """The rows of ``work`` in one forward, each under its item's adapter."""
    with torch.inference_mode(), layers.step([(item.lora, len(item.tokens)) for item in work]):
        return model(input_ids=ROWS[: len(work)]).logits.clone()


def work_of(step: tuple[str | None, ...], served: dict[str, LoraHandle]) -> list[Work]:
    return [
        Work(ROWS[row].tolist(), 0, [0], True, lora=None if name is None else served[name])
        for row, name in enumerate(step)
    ]


class Told(RankGroup):
    """Rank 0's control channel in threads: each message put on every follower's queue."""

    def __init__(self, queues: list[queue.Queue[Message]]):
        self.layout = Layout(0, len(queues) + 1, 0, "")
        self.queues = queues
        self.sent: list[Message] = []

    def send(self, message: Message) -> None:  # type: ignore[override]
        self.sent.append(message)
        for waiting in self.queues:
            waiting.put(message)


def ranks_logits(base: Path, adapters: dict[str, Path], ranks: int) -> tuple[list[list[torch.Tensor]], Told]:
    """Each rank's logits of every step of :data:`STEPS`: rank 0 reads the adapters and tells the
    others each step through its :class:`Relay`; they know the adapters only from what it tells."""
    summing = ThreadSum(ranks)
    queues: list[queue.Queue[Message]] = [queue.Queue() for _ in range(ranks - 1)]
    told = Told(queues)
    shards = [wrapped(base, Shard(rank, ranks, summing.of(rank))) for rank in range(ranks)]
    results: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
    failures: list[BaseException] = []

    def lead() -> None:
        model, layers = shards[0]
        served, relay = handles(adapters, layers), Relay(told, layers)
        for step in STEPS:
            work = work_of(step, served)
            relay.execute(work, None)
            results[0].append(forward(model, layers, work))

    def follow(rank: int) -> None:
        model, layers = shards[rank]
        for _ in STEPS:
            message = queues[rank - 1].get(timeout=60)
            assert isinstance(message, Execute)
            results[rank].append(forward(model, layers, message.work))

    def run(target: Any, *args: Any) -> None:
        try:
            target(*args)
        except BaseException as error:  # the other ranks are stopped at once, not left waiting
            failures.append(error)
            summing._barrier.abort()
            for waiting in queues:
                waiting.put(Score([], 0))

    threads = [threading.Thread(target=run, args=(lead,), daemon=True)]
    threads += [threading.Thread(target=run, args=(follow, rank), daemon=True) for rank in range(1, ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    return results, told


@pytest.mark.parametrize(("family", "ranks"), [("llama", 2), ("llama", 4), ("qwen3_moe", 2)])
def test_every_rank_of_a_sharded_wrapped_model_computes_the_whole_wrapped_models_logits(
    checkpoints: dict[str, tuple[Path, dict[str, Path]]], family: str, ranks: int
) -> None:
    # llama over 4 ranks replicates each of its 2 KV heads on two ranks (their k/v B rows alike).
    base, adapters = checkpoints[family]
    model, layers = wrapped(base)
    served = handles(adapters, layers)
    whole = [forward(model, layers, work_of(step, served)) for step in STEPS]
    plain = forward(model, layers, work_of((None, None, None), served))
    for step, logits in zip(STEPS, whole, strict=True):  # the adapters move the logits: the test can fail
        for row, name in enumerate(step):
            moved = float((logits[row] - plain[row]).abs().max())
            assert (moved > 0.05) if name else moved == 0, (step, row, moved)
    sharded, told = ranks_logits(base, adapters, ranks)
    for rank_logits in sharded:
        assert len(rank_logits) == len(STEPS)
        for got, want in zip(rank_logits, whole, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    carried = [
        {item.lora.name for item in message.work if item.lora is not None and item.lora.weights is not None}
        for message in told.sent
        if isinstance(message, Execute)
    ]
    assert carried == list(FILLED)


def test_a_shards_wrapped_projections_take_their_share_of_the_adapter(
    checkpoints: dict[str, tuple[Path, dict[str, Path]]],
) -> None:
    base, adapters = checkpoints["llama"]  # 4 heads of 16, 2 KV heads, hidden 64, an MLP of 64
    model, layers = wrapped(base, Shard(1, 2, lambda tensor: None))
    attention = model.model.layers[0].self_attn
    assert layers.targets["model.layers.0.self_attn.k_proj"] == (64, 32)  # the whole projection's
    assert attention.o_proj.part.lora_a.shape == (MAX_LORAS, MAX_RANK, 32)  # wrapped before the sum
    served = handles(adapters, layers)
    layers.slot_of(served["alpha"], {1})
    a, b = served["alpha"].weights.modules["model.layers.0.self_attn.o_proj"]
    assert torch.equal(attention.o_proj.part.lora_a[0], a[:, 32:]) and torch.equal(
        attention.o_proj.part.lora_b[0], b
    )
    a, b = served["alpha"].weights.modules["model.layers.0.mlp.up_proj"]
    up = model.model.layers[0].mlp.up_proj
    assert torch.equal(up.lora_a[0], a) and torch.equal(up.lora_b[0], b[32:])


def test_a_scored_prompt_tells_its_adapter_with_its_weights_until_a_slot_holds_it(
    checkpoints: dict[str, tuple[Path, dict[str, Path]]],
) -> None:
    base, adapters = checkpoints["llama"]
    _, layers = wrapped(base, Shard(0, 2, lambda tensor: None))
    served = handles(adapters, layers)
    told = Told([])
    relay = Relay(told, layers)
    relay.score([1, 2, 3], 2, served["beta"])
    layers.slot_of(served["beta"], {2})
    relay.score([1, 2, 3], 2, served["beta"])
    relay.score([1, 2, 3], 2, None)
    first, second, third = told.sent
    assert (
        isinstance(first, Score) and first.lora is not None and first.lora.weights is served["beta"].weights
    )
    assert isinstance(second, Score) and second.lora is not None and second.lora.weights is None
    assert second.lora.uid == served["beta"].uid and third == Score([1, 2, 3], 2, None)


def test_a_quantized_shard_keeps_its_cuts_for_the_adapters(
    checkpoints: dict[str, tuple[Path, dict[str, Path]]],
) -> None:
    # The loader quantizes a rank's shards after the cut (new modules): the cuts stay with the parents.
    base, adapters = checkpoints["llama"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    shard_model(model, Shard(1, 2, lambda tensor: None))
    quantize_linears(model, "int8")
    layers = LoraLayers(model, MAX_LORAS, MAX_RANK)
    assert len(layers.layers) == 14 and layers.targets["model.layers.1.mlp.down_proj"] == (64, 64)
    assert {type(layer.base).__name__ for layer in layers.layers.values()} == {"Int8Linear"}
    assert handles(adapters, layers)["alpha"].weights.rank == 8  # checked against the whole shapes
