"""The 8-bit KV cache (``--kv-cache-dtype int8|fp8``, worker/attention/kv_quant.py): codes and scales,
the pool's size, every attention path reading them (decode rows, chunks, whole prompts,
batch-invariant tiles; the Triton decode kernel in triton's interpreter, a child process) on tiny
families, Gemma 4's per-layer geometry and a hybrid among them, and the settings that refuse it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.tiny_families import tiny_config, tiny_model
from tests.triton_interpreter import interpreted_results, print_results
from tests.unit.worker import test_batch_invariant as invariant
from tests.unit.worker.test_model_families import BLOCK, VOCAB, loaded, run_scenario
from worker.attention import paged
from worker.attention.kv_pool import KVShape, LayerCache, kv_shape, pool_blocks
from worker.attention.kv_quant import SCALE_DTYPE, KVQuant, kv_quant
from worker.attention.triton_decode import (
    KVScales,
    paged_decode_attention,
    paged_decode_reference,
    plan_decode,
    triton_available,
)
from worker.config import parse_config
from worker.model import runner_setup
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work
from worker.quant.layers import cpu_kernels_available

pytestmark = pytest.mark.slow  # left out of make test-fast

BLOCK_TOKENS = 16  # --kv-block-size's default


def _rows(seed: int = 0) -> torch.Tensor:
    """Head rows of very different magnitudes (a scale each), one of zeros."""
    generator = torch.Generator().manual_seed(seed)
    x = (
        torch.randn((6, 3, 64), generator=generator)
        * torch.tensor([1e-6, 1e-2, 1.0, 30.0, 500.0, 0.0])[:, None, None]
    )
    return x


# 64 dims: int8 keys per 4, fp8 keys per head, values per 32
@pytest.mark.parametrize(
    ("cache", "keys", "groups"), [("int8", True, 16), ("fp8", True, 1), ("int8", False, 2), ("fp8", False, 2)]
)
def test_codes_come_back_within_their_step(cache: str, keys: bool, groups: int) -> None:
    quant = kv_quant(cache)
    assert quant is not None and kv_quant("auto") is None
    x = _rows()
    codes, scales = quant.quantize(x, keys)
    assert codes.dtype == quant.code_dtype and codes.shape == x.shape
    assert scales.dtype == SCALE_DTYPE and scales.shape == (*x.shape[:2], groups)
    back = quant.dequantize(codes, scales, torch.float32)
    step = scales.float().repeat_interleave(64 // groups, dim=-1)
    # int8: half a step of the row's scale (the grid is the rounded scale's); e4m3: half an ulp of
    # 3 mantissa bits, or of the subnormals' 2^-9 steps.
    bound = step * 0.5 if cache == "int8" else torch.maximum(x.abs() * 2**-4, step * 2**-10)
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6) + 1e-30)
    assert torch.equal(back[5], torch.zeros_like(back[5]))  # zeros (padding) stay zeros
    assert torch.equal(quant.round_trip(x, keys), back)


def test_a_key_outlier_coarsens_only_its_group_of_four() -> None:
    """A key channel 100x the others (the default model's keys have such channels) leaves the
    other 60 dims of its head row with their own fine steps; a value's group of 32 shares its step."""
    quant = KVQuant("int8")
    x = torch.linspace(-1, 1, 64).repeat(2, 1)
    x[:, 5] = 100.0
    keys, values = (quant.round_trip(x, k) - x for k in (True, False))
    assert keys[:, 4:8].abs().max() <= 0.5 * 100 / 127 * 1.01
    assert keys[:, 8:].abs().max() <= 0.5 / 127 * 1.01  # a group of 4 dims within [-1, 1]
    assert values[:, :32].abs().max() > 10 * keys[:, 8:32].abs().max()


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        kv_quant("int4")


def scaled_head_bytes(cache: str, scale_bytes: int) -> int:
    """A 64-dim head row's key and value: codes, and scales (int8 keys per 4 dims, fp8 keys per
    head, values per 32 dims) of ``scale_bytes`` each."""
    key_groups = 16 if cache == "int8" else 1
    return (64 + scale_bytes * key_groups) + (64 + scale_bytes * 2)


def test_a_float32_model_gets_float32_scales() -> None:
    """A float32 cache's scales are float32, so the grid is each group's own (a group's largest
    magnitude maps to 127 exactly); a half-precision cache keeps two-byte scales."""
    quant = kv_quant("int8", torch.float32)
    assert quant is not None and quant.scale_dtype == torch.float32
    assert all(
        kv_quant(c, d).scale_dtype == SCALE_DTYPE
        for c in ("int8", "fp8")
        for d in (torch.bfloat16, torch.float16)
    )  # type: ignore[union-attr]
    x = _rows()
    codes, scales = quant.quantize(x, True)
    assert scales.dtype == torch.float32
    groups = x[:5].unflatten(-1, (16, 4)).abs().amax(-1)
    assert torch.equal(
        codes[:5].unflatten(-1, (16, 4)).abs().amax(-1), torch.full_like(groups, 127, dtype=torch.int8)
    )
    coarse = KVQuant("int8")
    assert (quant.round_trip(x, True) - x).abs().sum() < (coarse.round_trip(x, True) - x).abs().sum()


@pytest.mark.parametrize(
    ("cache", "dtype", "least"),
    [
        ("int8", torch.float32, 2.5),
        ("int8", torch.bfloat16, 1.55),
        ("fp8", torch.float32, 3.6),
        ("fp8", torch.bfloat16, 1.9),
    ],
)
def test_the_pool_holds_more_tokens_in_the_same_bytes(
    cache: str, dtype: torch.dtype, least: float, caplog: pytest.LogCaptureFixture
) -> None:
    """SmolLM2-135M's shape (30 layers, 3 kv heads of 64): codes and scales (float32 for a float32
    model, else bfloat16) counted per token, the pool sized from the same bytes (int8 2.5x a float32
    pool's tokens, 1.55x a bfloat16 one's; fp8, the compact one, 1.9x a bfloat16 pool's), and the
    start-up log saying what it gained."""
    plain = KVShape.uniform(30, 3, 64, dtype, group=3)
    quantized = KVShape.uniform(30, 3, 64, dtype, group=3, cache=cache)
    scale_bytes = 4 if dtype == torch.float32 else 2
    assert quantized.bytes_per_token == 30 * 3 * scaled_head_bytes(cache, scale_bytes)
    budget = 1 << 30
    sizes = [
        pool_blocks(shape, 16, torch.device("cpu"), tokens=None, cpu_bytes=budget, gpu_memory_fraction=0.9)
        for shape in (plain, quantized)
    ]
    assert sizes[1] / sizes[0] >= least
    with caplog.at_level(logging.INFO, logger="worker.attention.kv_pool"):
        pool_blocks(
            quantized, 16, torch.device("cpu"), tokens=None, cpu_bytes=budget, gpu_memory_fraction=0.9
        )
    said = f"--kv-cache-dtype {cache}: {quantized.bytes_per_token} bytes per token against "
    assert said + str(plain.bytes_per_token) in caplog.text


def test_the_setting_reaches_the_pool(caplog: pytest.LogCaptureFixture) -> None:
    """``--kv-cache-dtype`` through the worker's start-up (runner_setup): the pool holds codes and is
    sized by their bytes from ``--kv-cache-bytes``, and the start-up log says what it gained."""
    model = tiny_model(tiny_config("llama"))
    budget = 1 << 20
    runners = {}
    with caplog.at_level(logging.INFO, logger="worker.attention.kv_pool"):
        for cache in ("auto", "int8"):
            config = parse_config(["--kv-cache-dtype", cache, "--kv-cache-bytes", str(budget)], environ={})
            runners[cache], _ = runner_setup.model_runner(loaded(model), config)  # type: ignore[arg-type]
    assert runners["int8"].pool.keys[0].dtype == torch.int8
    assert runners["auto"].pool.keys[0].dtype == torch.float32
    shape = runners["int8"].kv_shape
    assert runners["int8"].num_blocks == budget // (BLOCK_TOKENS * shape.bytes_per_token)
    # head dim 16: keys in 4 groups, values in one, float32 scales: 52 bytes per head against 128
    assert runners["int8"].num_blocks >= 2.4 * runners["auto"].num_blocks
    assert "--kv-cache-dtype int8: " in caplog.text and "x the tokens" in caplog.text


def test_gemma4_layers_keep_their_own_geometry_and_sharing() -> None:
    """Per-layer head dims, and the KV-sharing layers' blocks (their source's codes and float32
    scales)."""
    config = tiny_config("gemma4_text")
    shape = kv_shape(config, torch.float32, "int8")
    owners = [layer for i, layer in enumerate(shape.layers) if shape.owns_blocks(i)]
    assert len({layer.head_dim for layer in owners}) == 2
    assert shape.bytes_per_token == sum(
        layer.kv_heads
        * sum(
            layer.head_dim + 4 * layer.head_dim // KVQuant("int8").group_dims(layer.head_dim, keys)
            for keys in (True, False)
        )
        for layer in owners
    )
    runner = ModelRunner(loaded(tiny_model(config)), num_blocks=8, block_size=BLOCK, kv_cache_dtype="int8")
    pool = runner.pool
    assert pool.layers[3] is pool.layers[2] and pool.layers[4] is pool.layers[1]
    for layer, cache in zip(shape.layers, pool.layers, strict=True):
        assert cache.keys.dtype == torch.int8 and cache.keys.shape[-1] == layer.head_dim
        assert cache.key_scales is not None and cache.key_scales.shape[:3] == cache.keys.shape[:3]
        assert cache.key_scales.dtype == torch.float32


@contextlib.contextmanager
def float_pool_holding(cache: str, dtype: torch.dtype = torch.float32) -> Iterator[None]:
    """A float pool that stores each key and value as ``cache`` for a ``dtype`` model gives them
    back: what every read of the quantized pool must equal."""
    quant = kv_quant(cache, dtype)
    assert quant is not None
    write, stored = LayerCache.write, LayerCache.stored

    def rounded_write(
        self: LayerCache, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        write(self, slots, quant.round_trip(keys, True), quant.round_trip(values, False))

    def rounded_stored(self: LayerCache, new: torch.Tensor, dtype: torch.dtype, keys: bool) -> torch.Tensor:
        return quant.round_trip(stored(self, new, dtype, keys), keys)

    LayerCache.write, LayerCache.stored = rounded_write, rounded_stored  # type: ignore[method-assign]
    try:
        yield
    finally:
        LayerCache.write, LayerCache.stored = write, stored  # type: ignore[method-assign]


def short_scenario(runner: ModelRunner) -> list[torch.Tensor]:
    """Two prompts (one whole, one in two chunks: a whole first chunk, then a chunk over cached
    context beside a decode row), then decode rows of both; the logits of every step."""
    a, b = [(3 + 7 * i) % VOCAB for i in range(13)], [(5 + 11 * i) % VOCAB for i in range(9)]
    ta, tb = list(range(0, 8)), list(range(8, 16))
    rows = [runner.execute([Work(a[:8], 0, ta, False), Work(b, 0, tb, True)])]
    rows.append(runner.execute([Work(a[8:], 8, ta, True), Work([17], 9, tb, True)]))
    for step in range(3):
        rows.append(
            runner.execute([Work([20 + step], 13 + step, ta, True), Work([30 + step], 10 + step, tb, True)])
        )
    return rows


def scenario_logits(runner: ModelRunner, scenario: str) -> list[torch.Tensor]:
    if scenario == "short":
        return short_scenario(runner)
    return [row for sequence in run_scenario(runner) for _, row in sequence.checks]


def check_quantized_family(
    family: str, cache: str, scenario: str = "short", triton_decode: bool = False
) -> None:
    """A scenario on the ``cache`` pool equals it on a float pool holding the same rounded keys and
    values (``full``: test_model_families' chunks, decode and verifying rows; ``short``: fewer
    steps of the same kinds); ``full`` also checks that the rounding matters."""
    model = tiny_model(tiny_config(family))
    quantized = ModelRunner(
        loaded(model), num_blocks=100, block_size=BLOCK, kv_cache_dtype=cache, triton_decode=triton_decode
    )
    assert quantized.pool.keys[quantized.kv_shape.layers[-1].source].dtype == KVQuant(cache).code_dtype
    got = scenario_logits(quantized, scenario)
    with float_pool_holding(cache):
        want = scenario_logits(ModelRunner(loaded(model), num_blocks=100, block_size=BLOCK), scenario)
    for step, (row, reference) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(row, reference, atol=1e-4, rtol=1e-4, msg=f"row {step}")
    if scenario == "full":  # the check is sensitive: unrounded keys and values give other logits
        plain = scenario_logits(ModelRunner(loaded(model), num_blocks=100, block_size=BLOCK), scenario)
        assert max((a - b).abs().max().item() for a, b in zip(got, plain, strict=True)) > 1e-3


def test_every_path_reads_the_codes_it_wrote() -> None:
    check_quantized_family("llama", "int8", "full")


def test_two_runs_give_the_same_logits() -> None:
    model = tiny_model(tiny_config("llama"))
    runs = [
        short_scenario(ModelRunner(loaded(model), num_blocks=100, block_size=BLOCK, kv_cache_dtype="fp8"))
        for _ in range(2)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize(
    ("family", "cache"), [("gemma4_text", "int8"), ("gpt_oss", "fp8"), ("qwen3_5_text", "int8")]
)
def test_per_layer_geometry_sinks_and_hybrids_read_their_codes(family: str, cache: str) -> None:
    """Gemma 4's per-layer head dims and shared KV, gpt-oss's sinks and windows in fp8, and a hybrid
    model's attention layers (its recurrent states untouched)."""
    check_quantized_family(family, cache)


@pytest.mark.parametrize(
    "setting",
    [["--fake-tokens"], ["--task", "embed"]],
)
def test_settings_without_a_kv_cache_refuse_it(
    setting: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """One line at start-up, naming both settings."""
    with pytest.raises(SystemExit):
        parse_config(["--kv-cache-dtype", "int8", *setting], environ={})
    assert "error: --kv-cache-dtype int8 needs a generating model; " in capsys.readouterr().err
    assert parse_config(["--kv-cache-dtype", "fp8"], environ={}).kv_cache_dtype == "fp8"


@pytest.mark.skipif(not cpu_kernels_available(), reason="no int4/int8 CPU kernels in this torch")
def test_batch_invariant_steps_stay_bit_exact_on_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    """test_batch_invariant's scenario on an int8 cache: alone, crowded, chunked and resumed, the
    same bits (quantizing a row and widening it are per row and elementwise)."""
    monkeypatch.setattr(paged, "INVARIANT_TILE_BYTES", 64 << 10)
    monkeypatch.setattr(invariant, "STEPS", 8)  # past the prompt's 64-token key padding still
    runner = ModelRunner(
        invariant.tiny_int4_model(),
        num_blocks=300,
        block_size=BLOCK,
        batch_invariant=True,
        kv_cache_dtype="int8",
    )
    generated, reference = invariant.alone(runner)
    for step, (got, want) in enumerate(zip(invariant.crowded(runner, generated), reference, strict=True)):
        assert torch.equal(got, want), f"step {step}"
    for k in (0, 5, invariant.STEPS):
        assert torch.equal(invariant.resumed(runner, generated, k), reference[k]), f"resumed after {k} tokens"


def check_kernel(cache: str, dtype: torch.dtype, split: bool, variant: bool = False) -> None:
    """The Triton decode kernel on codes and scales against the reference on what they give back:
    rows of 0, 1, a block and lengths ending inside blocks, GQA of 3, a split plan or one pass; the
    scales float32 for float32 queries, as a float32 model's pool holds them."""
    generator = torch.Generator().manual_seed(3)
    quant = kv_quant(cache, dtype)
    assert quant is not None
    blocks, size, kv_heads, head_dim, heads = 12, 16, 2, 64, 6
    lengths = torch.tensor([37, 0, 1, 16, 70], dtype=torch.int32)
    raw = [torch.randn((blocks, size, kv_heads, head_dim), generator=generator) * 4 for _ in range(2)]
    (key_codes, key_scales), (value_codes, value_scales) = (
        quant.quantize(t, k) for t, k in zip(raw, (True, False), strict=True)
    )
    keys = quant.dequantize(key_codes, key_scales, torch.float32)  # the values the codes stand for
    values = quant.dequantize(value_codes, value_scales, torch.float32)
    query = torch.randn((5, heads, head_dim), generator=generator).to(dtype)
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:6] for _ in range(5)]).to(torch.int32)
    plan = plan_decode(5, kv_heads, 6, size, split_k=split, partition_tokens=32 if split else None)
    extra = (
        {"window": 20, "softcap": 2.0, "sinks": torch.randn(heads, generator=generator)} if variant else {}
    )
    got = paged_decode_attention(
        query,
        key_codes,
        value_codes,
        tables,
        lengths,
        0.125,
        plan=plan,
        scales=KVScales(key_scales, value_scales, cache),
        **extra,  # type: ignore[arg-type]
    )
    want = paged_decode_reference(query, keys, values, tables, lengths, 0.125, **extra)  # type: ignore[arg-type]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert torch.all(got[1] == 0)


KERNEL_CHECKS = {
    "int8-fp32-single": partial(check_kernel, "int8", torch.float32, False),
    # float16, not bfloat16: the interpreter rounds to bfloat16 by truncation (test_fused_kernels.py)
    "int8-fp16-split": partial(check_kernel, "int8", torch.float16, True),
    "fp8-fp32-split": partial(check_kernel, "fp8", torch.float32, True),
    "fp8-fp16-single": partial(check_kernel, "fp8", torch.float16, False),
    "int8-window-softcap-sinks-split": partial(check_kernel, "int8", torch.float32, True, True),
    "fp8-window-softcap-sinks-single": partial(check_kernel, "fp8", torch.float32, False, True),
    "runner-gemma4-int8": partial(check_quantized_family, "gemma4_text", "int8", triton_decode=True),
    "runner-gpt_oss-fp8": partial(check_quantized_family, "gpt_oss", "fp8", triton_decode=True),
}


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return interpreted_results("tests.unit.worker.test_kv_quant")


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("name", list(KERNEL_CHECKS))
def test_the_triton_kernel_reads_codes(name: str, interpreter_results: dict[str, str | None]) -> None:
    failure = interpreter_results[name]
    assert failure is None, failure


if __name__ == "__main__":  # the child process of `interpreter_results`
    print_results(KERNEL_CHECKS)


# The default model in float32, 88 positions of bench/bench_kv_cache_dtype.py's text teacher-forced
# through the pool (docs/benchmarks.md, "An 8-bit KV cache"): measured int8 0.0080 mean / 0.038 max
# with float32 scales. Bounds with room for another CPU's float rounding (the worst position moved
# by half between two machines with bfloat16 scales); fp8's figures come from the bench alone.
INT8_MEAN, INT8_LARGEST = 0.015, 0.08


def test_the_default_model_stays_within_the_measured_tolerance(default_model_dir: Path) -> None:
    """The default model's text teacher-forced through the int8 pool: every position's logprob
    within the measured tolerance of the float cache's, and a second run of the same pool (over
    the text's first 48 tokens) giving the same logprobs bit for bit."""
    from bench.bench_kv_cache_dtype import TEXT, forced_logprobs, runner
    from worker.model.loader import load_model

    loaded = load_model(str(default_model_dir), device="cpu", dtype="float32", quantization="none")
    ids = list(loaded.tokenizer(TEXT)["input_ids"])
    want = forced_logprobs(runner(loaded, "auto", blocks=8), ids)
    got = forced_logprobs(runner(loaded, "int8", blocks=8), ids)
    diff = (got - want).abs()
    assert float(diff.mean()) < INT8_MEAN and float(diff.max()) < INT8_LARGEST, (diff.mean(), diff.max())
    assert float(diff.max()) > 0  # the pool's rounding reaches the logits
    again = forced_logprobs(runner(loaded, "int8", blocks=8), ids[:48])
    assert torch.equal(again, got[: len(again)])
