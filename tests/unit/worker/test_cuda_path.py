"""The CUDA path on a GPU (`make gpu-check` runs these; without CUDA they skip, saying why, and with
SLUICE_REQUIRE_CUDA=1 that skip is a failure): graphs against eager, the sampler, sizing, cuda:N."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from worker.attention.triton_decode import triton_available
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work
from worker.sampling.sampler import SequenceSampling, sample_batch
from worker.types import SamplingOptions

HAVE_CUDA = torch.cuda.is_available() and triton_available()
if os.environ.get("SLUICE_REQUIRE_CUDA") == "1" and not HAVE_CUDA:
    raise RuntimeError("SLUICE_REQUIRE_CUDA=1 but CUDA or triton is missing: the CUDA tests cannot run")
pytestmark = pytest.mark.skipif(
    not HAVE_CUDA, reason="needs a CUDA device and triton (make gpu-check runs these)"
)
ROWS = (1, 3, 16, 17, 100, 256)


def cuda_runner(device: str = "cuda", max_rows: int = 256) -> ModelRunner:
    from worker.model.cuda_graphs import capture_decode_graphs

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    loaded = SimpleNamespace(
        model=model, device=torch.device(device), dtype=torch.bfloat16, context_length=1024
    )
    runner = ModelRunner(loaded, num_blocks=max_rows * 4 + 8, block_size=16)  # type: ignore[arg-type]
    assert runner.decode_kernel_enabled, runner.kernel_problem
    runner.graphs = capture_decode_graphs(runner, max_rows, 1024)
    assert runner.graphs is not None
    assert runner.graphs.replays == 0  # the capture's own check is not an engine step
    return runner


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return cuda_runner()


@pytest.mark.parametrize("rows", ROWS)
def test_a_replayed_step_equals_the_eager_step(runner: ModelRunner, rows: int) -> None:
    work = []
    for row in range(rows):  # contexts of 1..60 tokens over each row's own 4 blocks
        table = [row * 4 + b for b in range(4)]
        prompt = [(row * 7 + t) % 500 + 1 for t in range(row % 60 + 1)]
        runner.execute([Work(prompt, 0, table, True)])
        work.append(Work([5], len(prompt), table, True))
    graphs = runner.graphs
    assert graphs is not None
    before = graphs.replays
    replayed = runner.execute(work).clone()
    assert graphs.replays == before + 1
    runner.graphs = None
    try:
        eager = runner.execute(work)
    finally:
        runner.graphs = graphs
    torch.testing.assert_close(replayed, eager, atol=5e-2 * float(eager.abs().max()), rtol=5e-2)


@pytest.mark.parametrize("rows", (1, 17, 100))
def test_placeholder_tokens_fed_from_the_previous_draw_equal_known_tokens(
    runner: ModelRunner, rows: int
) -> None:
    """Steps that overlap: a replayed step whose tokens are placeholders naming rows of a draw still
    on the device computes what the same step with those tokens written out computes."""
    drawn = torch.tensor([(row * 13) % 500 + 1 for row in range(rows)], device="cuda")
    known, fed = [], []
    for row in range(rows):
        table = [row * 4 + b for b in range(4)]
        prompt = [(row * 5 + t) % 500 + 1 for t in range(row % 40 + 1)]
        runner.execute([Work(prompt, 0, table, True)])
        known.append(Work([int(drawn[row])], len(prompt), table, True))
        fed.append(Work([-(row + 1)], len(prompt), table, True))
    assert runner.graphs is not None and runner.graphs.fits(rows)
    written = runner.execute(known).clone()
    placeheld = runner.execute(fed, drawn)
    torch.testing.assert_close(placeheld, written, atol=0, rtol=0)


OPTIONS = {
    "greedy": SamplingOptions(temperature=0.0),
    "temperature": SamplingOptions(temperature=0.7, seed=1),
    "top_p": SamplingOptions(top_p=0.5, seed=1),
    "top_k": SamplingOptions(top_k=5, seed=1),
    "min_p": SamplingOptions(min_p=0.2, seed=1),
    "penalties": SamplingOptions(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, seed=1),
    "logit_bias": SamplingOptions(logit_bias=((7, 100.0),), seed=1),
    "logprobs": SamplingOptions(logprobs=3, seed=1),
    "min_tokens": SamplingOptions(min_tokens=2, seed=1),
    "allowed_token_ids": SamplingOptions(allowed_token_ids=(3, 9, 40, 63), seed=1),
    "bad_words": SamplingOptions(bad_words=tuple((t,) for t in range(0, 64, 2)), seed=1),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_sampler_on_cuda_draws_what_it_draws_on_the_cpu(name: str) -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 64)
    rows = [SequenceSampling(OPTIONS[name], (1, 2, 3), frozenset({0})) for _ in range(4)]
    for row in rows:
        row.seed = 11
    on_cpu = sample_batch(logits, rows)
    on_gpu = sample_batch(logits.cuda(), rows)
    assert [s.token_id for s in on_gpu] == [s.token_id for s in on_cpu]


def test_the_pool_takes_the_set_fraction_of_free_memory() -> None:
    from worker.attention.kv_pool import KVShape, pool_blocks

    shape = KVShape.uniform(24, 32, 64, torch.bfloat16)
    free, _ = torch.cuda.mem_get_info()
    blocks = pool_blocks(
        shape, 16, torch.device("cuda"), tokens=None, cpu_bytes=1 << 30, gpu_memory_fraction=0.5
    )
    per_block = 2 * 24 * 16 * 32 * 64 * 2
    assert 0.4 * free <= blocks * per_block <= 0.55 * free


def test_an_explicit_device_index_serves_on_that_device() -> None:
    index = torch.cuda.device_count() - 1  # cuda:1 where there are two devices
    runner = cuda_runner(f"cuda:{index}", max_rows=4)
    logits = runner.execute([Work([1, 2, 3], 0, [0], True)])
    assert logits.device == torch.device(f"cuda:{index}")


def test_host_syncs_and_cuda_calls_per_replayed_step(runner: ModelRunner) -> None:
    """Printed for the report: CUDA API calls and synchronisations of one replayed 64-row step."""
    from torch.profiler import ProfilerActivity, profile

    work = [Work([5], 3, [row * 4], True) for row in range(64)]
    runner.execute(work)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.execute(work)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.name.startswith("cuda")]
    syncs = sum("Synchronize" in n for n in names) - 1  # the one above
    print(f"\nper replayed 64-row step: {len(names)} CUDA API calls, {syncs} host syncs, "
          f"{sum(n == 'cudaGraphLaunch' for n in names)} graph launches")  # fmt: skip
    assert sum(n == "cudaGraphLaunch" for n in names) == 1


def test_a_verifying_row_scores_like_one_token_steps(runner: ModelRunner) -> None:
    """A speculative verification row (``1 + proposed`` tokens after a context) runs as that many
    decode rows in one replayed graph: its logits at each position equal decoding the same tokens
    one at a time (replayed graphs too) over a copy of the same context."""
    prompt = [(7 * t) % 500 + 1 for t in range(21)]
    verified, stepped = [40, 41, 42, 43], [44, 45, 46, 47]  # each row's own blocks (rows 10 and 11)
    for table in (verified, stepped):
        runner.execute([Work(prompt, 0, table, True)])
    guesses = [9, 19, 29]
    assert runner.graphs is not None
    replays = runner.graphs.replays
    together = runner.execute([Work([5, *guesses], len(prompt), verified, True, proposed=len(guesses))])
    assert together.shape[0] == 1 + len(guesses)
    assert runner.graphs.replays == replays + 1
    # Each replay of a bucket rewrites that bucket's logits: keep a copy of each step's.
    one_by_one = torch.cat(
        [
            runner.execute([Work([token], len(prompt) + i, stepped, True)]).clone()
            for i, token in enumerate([5, *guesses])
        ]
    )
    torch.testing.assert_close(together, one_by_one, atol=5e-2 * float(one_by_one.abs().max()), rtol=5e-2)


def test_a_step_of_many_prompts_scores_each_as_alone(runner: ModelRunner) -> None:
    """Whole prompts of different lengths in one step are attended together (padded at their ends,
    one causal SDPA; worker/attention/prompt_batch.py): each one's logits equal its own step's."""
    lengths = [1, 30, 7, 2, 16, 16, 45]
    prompts = [[(11 * i + 3 * t) % 500 + 1 for t in range(n)] for i, n in enumerate(lengths)]
    tables = [[200 + i * 4 + b for b in range(4)] for i in range(len(prompts))]
    together = runner.execute([Work(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)]).clone()
    alone = torch.cat(
        [runner.execute([Work(p, 0, t, True)]).clone() for p, t in zip(prompts, tables, strict=True)]
    )
    torch.testing.assert_close(together, alone, atol=5e-2 * float(alone.abs().max()), rtol=5e-2)


def test_the_fused_kernels_round_as_the_modules_do_in_bfloat16() -> None:
    """On the GPU bfloat16 rounds to nearest (triton's interpreter truncates, so the CPU tests check
    float16): rotary within a few ulps of the products of the module's (an ulp apart here and there
    on an H200), RMSNorm equal but where the sums' order moves an ulp, and a fused model's logits
    stay close to its own."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from worker.model import fused

    torch.manual_seed(0)
    norm = LlamaRMSNorm(2048).to("cuda", torch.bfloat16)
    norm.weight.data.normal_()
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16) * 3
    got = fused.rms_norm(x, norm.weight, norm.variance_epsilon, scale_in_fp32=False)
    assert (got != norm(x)).float().mean() < 0.01
    q = torch.randn(8, 1, 32, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    angles = torch.rand(8, 1, 32, device="cuda") * 9
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    got = fused.rotary(q, cos, sin).float()
    rotated = torch.cat([-q[..., 32:], q[..., :32]], -1).float()
    products = (q.float() * cos.float()[:, None], rotated * sin.float()[:, None])
    exact, own = products[0] + products[1], apply_rotary_pos_emb(q, q, cos, sin)[0].float()
    # On an H200 (2026-11-29) the kernel and the module differed by a bf16 ulp here and there: each
    # is within a few ulps of the products of the exact value, and of the other.
    bound = (products[0].abs() + products[1].abs()) * 2**-6 + 1e-6
    assert ((got - exact).abs() <= bound).all() and ((own - exact).abs() <= bound).all()
    assert ((got - own).abs() <= bound).all()
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 512, (1, 40), device="cuda")
    with torch.inference_mode():
        before = model(input_ids=ids).logits.float()
        report = fused.fuse_model(model)
        after = model(input_ids=ids).logits.float()
    assert (report.norms, report.mlps, report.rotary, report.failure) == (5, 2, 2, None), report.describe()
    torch.testing.assert_close(after, before, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid"])
def test_a_hybrid_models_replayed_steps_follow_the_eager_ones_over_their_state_slots(family: str) -> None:
    """Graphs with a hybrid model's state slots as inputs: two runners over one tiny model, one
    replaying captured steps, decode the same sequences (a slot reused by a new sequence among
    them) to the same logits and leave the same states."""
    from tests.tiny_families import tiny_config, tiny_model
    from worker.model.cuda_graphs import capture_decode_graphs

    model = tiny_model(tiny_config(family)).to("cuda")
    loaded = SimpleNamespace(
        model=model, device=torch.device("cuda"), dtype=torch.float32, context_length=256
    )
    runners = [ModelRunner(loaded, num_blocks=64, block_size=16, max_sequences=4) for _ in range(2)]  # type: ignore[arg-type]
    eager, graphed = runners
    graphed.graphs = capture_decode_graphs(graphed, 4, 256)
    assert graphed.graphs is not None and graphed.graphs.states is not None
    prompts = {0: [3, 9, 27, 81, 5], 1: [7, 1, 4], 2: [11, 13, 17, 19, 23, 29, 31]}
    for runner in runners:
        for seq, ids in prompts.items():
            runner.execute([Work(ids, 0, [seq * 4 + b for b in range(4)], True, state_slot=seq)])
    for step in range(5):
        work = [
            Work([40 + step], len(prompts[s]) + step, [s * 4 + b for b in range(4)], True, state_slot=s)
            for s in (0, 2)
        ]
        work.append(Work([50 + step], step, [12 + b for b in range(4)], True, state_slot=1))  # slot 1 reused
        want = eager.execute(work)
        got = graphed.execute(work)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3, msg=f"step {step}")
    assert graphed.graphs.replays == 5
    assert eager.states is not None and graphed.states is not None
    for layer, states in eager.states.conv.items():
        torch.testing.assert_close(graphed.states.conv[layer][:4], states[:4], atol=1e-3, rtol=1e-3)


def test_replayed_steps_with_adapter_rows_equal_the_eager_steps() -> None:
    """LoRA adapters in the graphs (each row's slot a graph input, the per-row Triton kernels):
    adapters loaded after the capture (copied into the slots in place, a third refilling one of
    the two slots), decode steps mixing two adapters and base rows replay graphs and give the eager
    steps' logits (the segmented kernels); the adapters move the logits (a base step differs)."""
    from worker.lora.adapter import LoraWeights
    from worker.lora.triton_ops import TritonRowLora
    from worker.model.cuda_graphs import capture_decode_graphs
    from worker.types import LoraHandle

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    loaded = SimpleNamespace(
        model=model, device=torch.device("cuda"), dtype=torch.bfloat16, context_length=1024
    )
    runner = ModelRunner(loaded, num_blocks=64 * 4 + 8, block_size=16)  # type: ignore[arg-type]
    layers = runner.enable_lora(2, 16)
    assert isinstance(layers.row_ops, TritonRowLora)  # the per-row kernels passed their check
    graphs = capture_decode_graphs(runner, 64, 1024)
    assert graphs is not None and graphs.adapters
    runner.graphs = graphs
    slots = [(layer.lora_a, layer.lora_b) for layer in layers.layers.values()]
    pointers = [(a.data_ptr(), b.data_ptr()) for a, b in slots]

    def handle(uid: int, rank: int) -> LoraHandle:
        generator = torch.Generator().manual_seed(uid)
        modules = {
            name: (
                torch.randn(rank, features[0], generator=generator) * 0.05,
                torch.randn(features[1], rank, generator=generator) * 0.05,
            )
            for name, features in layers.targets.items()
        }
        return LoraHandle(f"a{uid}", uid, 2, LoraWeights(f"/a/{uid}", rank, modules))

    first, second, third = handle(1, 16), handle(2, 8), handle(3, 4)
    # The third adapter comes after the first two (its step refills the slot of one of them).
    for rows, choices in ((1, [first]), (5, [first, None, second]), (17, [second, None, first]),
                          (64, [third, first, None])):  # fmt: skip
        work = []
        for row in range(rows):
            table = [row * 4 + b for b in range(4)]
            prompt = [(row * 7 + t) % 500 + 1 for t in range(row % 50 + 1)]
            lora = choices[row % len(choices)]
            runner.execute([Work(prompt, 0, table, True, lora=lora)])
            work.append(Work([5], len(prompt), table, True, lora=lora))
        replays, adapter_replays = graphs.replays, graphs.adapter_replays
        replayed = runner.execute(work).clone()
        assert (graphs.replays, graphs.adapter_replays) == (replays + 1, adapter_replays + 1), rows
        runner.graphs = None
        try:
            eager = runner.execute(work)
            base = runner.execute([Work(w.tokens, w.start, w.table, True) for w in work])
        finally:
            runner.graphs = graphs
        scale = float(eager.abs().max())
        torch.testing.assert_close(replayed, eager, atol=5e-2 * scale, rtol=5e-2, msg=f"{rows} rows")
        adapted = [i for i, w in enumerate(work) if w.lora is not None]
        assert not torch.allclose(base[adapted], eager[adapted], atol=5e-2 * scale, rtol=5e-2)
    assert layers.holds(third.uid) and layers.holds(first.uid) != layers.holds(second.uid)  # refilled one
    assert [(a.data_ptr(), b.data_ptr()) for a, b in slots] == pointers  # in place
