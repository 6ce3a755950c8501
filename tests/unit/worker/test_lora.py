"""LoRA adapters on the engine over a tiny random Llama: each adapter's greedy tokens and prompt
logprobs against peft's merged model, mixed batches against sequential runs, an int4 base, the
prefix cache kept apart per adapter, and the adapter folders refused naming their problem."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest
import torch

from tests.lora_adapters import build_adapter, greedy_tokens, merged_model, prompt_logprobs
from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.engine.speculation import Speculation
from worker.errors import InvalidRequest, ModelNotFound
from worker.lora.adapter import AdapterError
from worker.lora.registry import LoraRegistry
from worker.model.draft import DraftModel
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.server import eos_token_ids
from worker.types import ContentDelta, GenerationRequest, LoraHandle, PromptLogprobs, SamplingOptions

pytestmark = pytest.mark.slow  # left out of make test-fast

STEPS = 16


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "alpha": build_adapter(tiny_model_dir, root / "alpha", seed=1),
        "beta": build_adapter(
            tiny_model_dir, root / "beta", seed=2, rank=4, targets=("q_proj", "v_proj", "down_proj")
        ),
    }


def serving(
    model_dir: Path,
    adapters: dict[str, Path],
    quantization: str = "none",
    max_loras: int = 2,
    speculation: Speculation | None = None,
):
    loaded = load_model(str(model_dir), device="cpu", dtype="float32", quantization=quantization)
    runner = ModelRunner(loaded, num_blocks=128, block_size=16)
    layers = runner.enable_lora(max_loras, 8)
    registry = LoraRegistry(
        layers.targets,
        served_model="tiny",
        max_loras=max_loras,
        max_rank=8,
        max_cpu_loras=2,
        dtype=torch.float32,
    )
    for name, folder in adapters.items():
        registry.load(name, str(folder))
    engine = Engine(
        runner,
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        speculation=speculation,
        options=EngineOptions(max_running=8, max_queue=100, prefill_budget_tokens=64, prefix_caching=True),
    )
    engine.start()
    return loaded, registry, engine


@pytest.fixture(scope="module")
def float_serving(tiny_model_dir, adapters):
    loaded, registry, engine = serving(tiny_model_dir, adapters)
    yield loaded, registry, engine
    engine.stop()


def request(prompt: list[int], lora: LoraHandle | None, **sampling) -> GenerationRequest:
    options = SamplingOptions(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS, **sampling)
    return GenerationRequest(f"r{random.random()}", tuple(prompt), options, time.monotonic(), True, lora=lora)


async def tokens_of(engine: Engine, req: GenerationRequest) -> tuple[list[int], list[float]]:
    events = [event async for event in engine.submit(req)]
    ids = [t for e in events if isinstance(e, ContentDelta) for t in e.token_ids]
    scored = [e for e in events if isinstance(e, PromptLogprobs)]
    return ids, [entry.logprob for entry in scored[0].logprobs] if scored else []


PROMPTS = [[5, 17, 300, 41, 9, 77, 123], [400, 12, 12, 7], [88, 99, 100, 101, 102, 103, 104, 105, 106]]


def test_each_adapter_equals_peft_merged_model(float_serving, tiny_model_dir, adapters):
    _, registry, engine = float_serving
    for name in (None, "alpha", "beta"):
        reference = merged_model(tiny_model_dir, None if name is None else adapters[name])
        handle = None if name is None else registry.resolve(name)
        for prompt in PROMPTS[:2]:
            ids, logprobs = asyncio.run(tokens_of(engine, request(prompt, handle, prompt_logprobs=0)))
            assert ids == greedy_tokens(reference, prompt, STEPS), name
            assert logprobs == pytest.approx(prompt_logprobs(reference, prompt), abs=1e-3), name
    # The adapters change the output (else the comparisons above prove nothing).
    alone = [
        asyncio.run(tokens_of(engine, request(PROMPTS[0], registry.resolve(n))))[0] for n in ("alpha", "beta")
    ]
    base = asyncio.run(tokens_of(engine, request(PROMPTS[0], None)))[0]
    assert alone[0] != base and alone[1] != base and alone[0] != alone[1]


def test_mixed_batch_equals_sequential_runs(float_serving):
    _, registry, engine = float_serving
    handles = [None, registry.resolve("alpha"), registry.resolve("beta")]
    jobs = [(prompt, handle) for prompt in PROMPTS for handle in handles]
    sequential = [asyncio.run(tokens_of(engine, request(p, h)))[0] for p, h in jobs]

    async def together():
        return await asyncio.gather(*[tokens_of(engine, request(p, h)) for p, h in jobs])

    assert [ids for ids, _ in asyncio.run(together())] == sequential


def test_speculation_keeps_each_adapters_tokens(float_serving, tiny_model_dir, adapters):
    """Rows under adapters verify proposals under their adapter: n-gram lookup and a draft model
    (the base alone, so its guesses for adapter rows are often rejected) give the tokens of the
    engine without speculation, in one mixed batch."""
    _, registry, plain = float_serving
    jobs = [(p, n) for p in PROMPTS[:2] for n in (None, "alpha", "beta")]
    expected = [asyncio.run(tokens_of(plain, request(p, n and registry.resolve(n))))[0] for p, n in jobs]
    drafting = load_model(str(tiny_model_dir), device="cpu", dtype="float32", quantization="none")
    for draft in (None, DraftModel(drafting, drafting)):
        _, loras, engine = serving(tiny_model_dir, adapters, speculation=Speculation(4, 1, 3, draft=draft))
        try:

            async def together(engine=engine, loras=loras):
                jobs_ = [tokens_of(engine, request(p, n and loras.resolve(n))) for p, n in jobs]
                return await asyncio.gather(*jobs_)

            assert [ids for ids, _ in asyncio.run(together())] == expected, draft
            counters = engine.stats().counters
            assert counters.speculative_proposed_tokens > counters.speculative_accepted_tokens > 0, draft
        finally:
            engine.stop()


def test_prefix_cache_never_crosses_adapters(float_serving):
    _, registry, engine = float_serving
    prompt = list(range(200, 240))  # two and a half blocks: two cacheable
    handles = {"base": None, "alpha": registry.resolve("alpha"), "beta": registry.resolve("beta")}
    # Alone, each computed with nothing cached under its own key...
    cold = {}
    for name, handle in handles.items():
        engine.blocks.clear_cache()
        cold[name] = asyncio.run(tokens_of(engine, request(prompt, handle)))[0]
    # ...and after the others cached the same tokens: the same, and no blocks reused across.
    engine.blocks.clear_cache()
    for name, handle in handles.items():
        hits = engine.stats().counters.prefix_cache_hit_tokens
        assert asyncio.run(tokens_of(engine, request(prompt, handle)))[0] == cold[name]
        assert engine.stats().counters.prefix_cache_hit_tokens == hits, name
    hits = engine.stats().counters.prefix_cache_hit_tokens  # its own prefix is reused
    assert asyncio.run(tokens_of(engine, request(prompt, handles["beta"])))[0] == cold["beta"]
    assert engine.stats().counters.prefix_cache_hit_tokens == hits + 32


def test_int4_base_equals_peft_merged_over_its_weights(tiny_model_dir, adapters):
    """The int4 kernel computes in bfloat16, so the prompt's logprobs are compared at 2e-2 (greedy
    tokens of a random model flip on such differences); the adapter moves them far more."""
    _, registry, engine = serving(tiny_model_dir, {"alpha": adapters["alpha"]}, quantization="int4")
    try:
        runner_layers = engine._runner.lora  # the int4 projections the adapters wrap
        assert all(type(layer.base).__name__ == "Int4Linear" for layer in runner_layers.layers.values())
        dequantized = {name: layer.base.dequantized() for name, layer in runner_layers.layers.items()}
        prompt = PROMPTS[0]
        _, logprobs = asyncio.run(
            tokens_of(engine, request(prompt, registry.resolve("alpha"), prompt_logprobs=0))
        )
        want = prompt_logprobs(merged_model(tiny_model_dir, adapters["alpha"], dequantized), prompt)
        assert logprobs == pytest.approx(want, abs=2e-2)
        base = prompt_logprobs(merged_model(tiny_model_dir, None, dequantized), prompt)
        assert max(abs(a - b) for a, b in zip(logprobs, base, strict=True)) > 0.2
    finally:
        engine.stop()


# ---------------------------------------------------------------- refusals and the registry


def registry_of(float_serving, *, max_rank: int = 8, max_cpu_loras: int = 2) -> LoraRegistry:
    _, _, engine = float_serving
    return LoraRegistry(
        engine._runner.lora.targets,
        served_model="tiny",
        max_loras=2,
        max_rank=max_rank,
        max_cpu_loras=max_cpu_loras,
        dtype=torch.float32,
    )


def fabricated(folder: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config})
    )
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def pair(module: str, fan_in: int, fan_out: int, rank: int = 2) -> dict[str, torch.Tensor]:
    prefix = f"base_model.model.{module}"
    return {
        f"{prefix}.lora_A.weight": torch.ones(rank, fan_in),
        f"{prefix}.lora_B.weight": torch.ones(fan_out, rank),
    }


def test_refusals_name_the_problem(float_serving, adapters, tmp_path):
    registry = registry_of(float_serving, max_rank=4)
    q = "model.layers.0.self_attn.q_proj"
    cases = {
        "does not exist or is not a folder": str(tmp_path / "missing"),
        "has no adapter_config.json": str((tmp_path / "empty").mkdir() or tmp_path / "empty"),
        "rank 8, above --max-lora-rank 4": str(adapters["alpha"]),
        "targets module 'lm_head', which the model lacks": str(
            fabricated(tmp_path / "head", pair("lm_head", 64, 100))
        ),
        "trained for another base model": str(fabricated(tmp_path / "wide", pair(q, 128, 64))),
        "DoRA is not supported": str(fabricated(tmp_path / "dora", pair(q, 64, 64), use_dora=True)),
    }
    for message, path in cases.items():
        with pytest.raises(AdapterError, match=message):
            registry.load("x", path)
    with pytest.raises(AdapterError, match="for base model 'other'; this worker serves 'tiny'"):
        registry.load("x", str(adapters["beta"]), "other")
    with pytest.raises(InvalidRequest, match="base model's name"):
        registry.load("tiny", str(adapters["beta"]))
    registry.load("x", str(adapters["beta"]), "tiny")
    with pytest.raises(InvalidRequest, match="already loaded"):
        registry.load("x", str(adapters["beta"]))
    assert registry.names() == [("x", str(adapters["beta"]))]


def test_host_memory_holds_max_cpu_loras_and_rereads_on_demand(float_serving, adapters):
    registry = registry_of(float_serving, max_cpu_loras=1)
    registry.load("a", str(adapters["alpha"]))
    registry.load("b", str(adapters["beta"]))
    assert [e.weights is not None for e in registry._entries.values()] == [False, True]
    first = registry.resolve("a")  # read again from its folder; b leaves host memory
    assert [e.weights is not None for e in registry._entries.values()] == [False, True]
    assert first.weights.rank == 8 and registry.resolve("a").uid == first.uid


def test_unloaded_adapter_is_not_found_but_held_handles_keep_working(float_serving, adapters):
    _, _, engine = float_serving
    registry = registry_of(float_serving)
    registry.load("a", str(adapters["alpha"]))
    held = registry.resolve("a")
    before = asyncio.run(tokens_of(engine, request(PROMPTS[1], held)))[0]
    registry.unload("a")
    with pytest.raises(ModelNotFound):
        registry.resolve("a")
    with pytest.raises(ModelNotFound):
        registry.unload("a")
    assert asyncio.run(tokens_of(engine, request(PROMPTS[1], held)))[0] == before
    registry.load("a", str(adapters["beta"]))  # the name again, another adapter: a new uid
    assert registry.resolve("a").uid != held.uid


def test_lora_modules_setting_forms():
    from worker.config import LoraModule, WorkerConfig, parse_config

    config = parse_config(["--enable-lora", "--lora-modules", "a=/x, b=/y"], {})
    assert config.lora_modules == (LoraModule("a", "/x"), LoraModule("b", "/y"))
    form = '[{"name": "a", "path": "/x", "base_model_name": "m"}]'
    assert parse_config(["--enable-lora", "--lora-modules", form], {}).lora_modules == (
        LoraModule("a", "/x", "m"),
    )
    lone = WorkerConfig(lora_modules=(LoraModule("a", "/x"),))
    assert lone.problems() == ["--lora-modules only applies with --enable-lora"]
    combined = WorkerConfig(enable_lora=True, engine_process=True, max_loras=4, max_cpu_loras=2)
    assert combined.problems() == [
        "--enable-lora cannot be combined with --engine-process yet "
        "(the adapters live in the serving process)",
        "--max-cpu-loras 2 is below --max-loras 4",
    ]
    servers = WorkerConfig(enable_lora=True, api_server_count=2)
    assert servers.runs_engine_process and servers.problems() == [
        "--enable-lora cannot be combined with --api-server-count yet "
        "(the adapters live in the serving process)"
    ]
    invariant = WorkerConfig(enable_lora=True, batch_invariant=True)
    assert invariant.problems() == [
        "--enable-lora cannot be combined with --batch-invariant yet "
        "(the adapters' float products depend on the batch)"
    ]
    # A draft model proposes the base model's tokens; rows verify them under their adapter.
    drafted = parse_config(["--enable-lora", "--speculative", "draft", "--draft-model", "/d"], {})
    assert drafted.problems() == []
    with pytest.raises(SystemExit):
        parse_config(["--enable-lora", "--lora-modules", "a"], {})


def test_only_decoder_attention_and_mlp_projections_are_wrapped(float_serving):
    from torch import nn

    from worker.lora.layers import LoraLayers

    _, _, engine = float_serving
    assert sorted({name.rsplit(".", 1)[-1] for name in engine._runner.lora.targets}) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert len(engine._runner.lora.targets) == 14  # two layers

    def block(**children: nn.Module) -> nn.Module:
        module = nn.Module()
        for name, child in children.items():
            setattr(module, name, child)
        return module

    layer = block(
        self_attn=block(q_proj=nn.Linear(4, 4)),
        linear_attn=block(out_proj=nn.Linear(4, 4)),  # a recurrent mixer's: called on groups of rows
        mlp=block(experts=nn.ModuleList([block(up_proj=nn.Linear(4, 4))]), up_proj=nn.Linear(4, 8)),
    )
    model = block(model=block(layers=nn.ModuleList([layer]), lm_head=nn.Linear(4, 9)))
    assert sorted(LoraLayers(model, 1, 2).targets) == [
        "model.layers.0.mlp.up_proj",
        "model.layers.0.self_attn.q_proj",
    ]
