"""Weight-only quantized layers, GGUF block repacking, quantized loading and the --quantization setting."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from worker.config import parse_config
from worker.model.loader import (
    AUTO_DEFAULT_MODEL_CPU,
    ModelLoadError,
    choose_quantization,
    default_gguf_path,
    load_model,
)
from worker.quant.gguf_blocks import repacked_linear
from worker.quant.gguf_file import read_gguf
from worker.quant.layers import (
    BATCH_ROWS,
    Fp8Linear,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    cpu_kernels_available,
    quantize_linears,
    quantize_weight,
)
from worker.quant.loading import unpermuted_rows

pytestmark = [
    pytest.mark.skipif(not cpu_kernels_available(), reason="no CPU int8/int4 kernels in this torch"),
    pytest.mark.slow,  # left out of make test-fast
]

CPU = torch.device("cpu")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs().max() / want.abs().max()).detach())


def random_weight(out_features: int = 96, in_features: int = 128) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.05


@pytest.mark.parametrize("layer_class", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_quantized_layer_computes_x_times_its_dequantized_weight(layer_class, rows):
    weight, bias = random_weight(), torch.randn(96)
    layer = layer_class.from_float(weight, bias)
    x = torch.randn(2, rows, 128)
    with torch.inference_mode():
        got = layer(x)
        want = torch.nn.functional.linear(x, layer.dequantized(), bias)
    assert got.shape == (2, rows, 96) and got.dtype == torch.float32
    # The kernels take bfloat16 activations: about 3 significant digits.
    assert relative_error(got, want) < 2e-2


@pytest.mark.parametrize("layer_class", [Int8Linear, Int4Linear])
def test_a_row_gets_the_same_output_alone_and_in_a_batch(layer_class):
    """One row multiplies with the 8/4-bit kernel, a batch with the float16 batch copy of the same
    weight: the two differ by rounding only."""
    layer = layer_class.from_float(random_weight())
    assert layer.batch_copy is not None
    batch = torch.randn(BATCH_ROWS + 3, 128)
    with torch.inference_mode():
        together = layer(batch)
        alone = torch.cat([layer(row[None]) for row in batch])
    assert relative_error(together, alone) < 1e-2


@pytest.mark.parametrize(("layer_class", "bound"), [(Int8Linear, 0.01), (Int4Linear, 0.1), (Fp8Linear, 0.07)])
def test_quantization_error_is_within_the_format_bound(layer_class, bound):
    weight = random_weight()
    layer = layer_class.from_float(weight)
    assert relative_error(layer.dequantized(), weight) < bound


def test_fp8_layer_computes_on_its_generic_path():
    weight = random_weight()
    layer = Fp8Linear.from_float(weight)
    x = torch.randn(3, 128)
    torch.testing.assert_close(layer(x), x @ layer.dequantized().t(), rtol=1e-4, atol=1e-4)


def test_int8_embedding_reads_the_output_layers_rows():
    table = Int8Linear.from_float(random_weight(50, 32))
    embedding = Int8Embedding(table)
    ids = torch.tensor([[0, 7, 49]])
    torch.testing.assert_close(embedding(ids), table.dequantized()[ids])


def gguf_tensor(tmp_path: Path, weight: np.ndarray, kind: GGMLQuantizationType):
    writer = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    raw = quantize(weight, kind)
    writer.add_tensor("w", raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFReader(str(tmp_path / "t.gguf")).tensors[0]


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_q4_blocks_repack_into_int4_without_requantizing(tmp_path, kind):
    weight = random_weight(64, 96).numpy()
    tensor = gguf_tensor(tmp_path, weight, kind)
    layer = repacked_linear(tensor, "int4")
    assert isinstance(layer, Int4Linear)
    want = torch.from_numpy(dequantize(np.asarray(tensor.data), kind).reshape(64, 96).astype(np.float32))
    # Same 4-bit values; only the block scale and offset are rounded to bfloat16 (8 significant bits).
    assert relative_error(layer.dequantized(), want) < 1e-2


def test_q8_0_blocks_become_a_per_row_int8_layer(tmp_path):
    weight = random_weight(64, 96).numpy()
    tensor = gguf_tensor(tmp_path, weight, GGMLQuantizationType.Q8_0)
    layer = repacked_linear(tensor, "int4")  # a Q8_0 tensor keeps its 8 bits under int4
    assert isinstance(layer, Int8Linear)
    want = torch.from_numpy(dequantize(np.asarray(tensor.data), GGMLQuantizationType.Q8_0).reshape(64, 96))
    assert relative_error(layer.dequantized(), want.float()) < 1e-2


def test_tensor_directory_matches_gguf_reader(tmp_path):
    weight = random_weight(64, 96).numpy()
    tensor = gguf_tensor(tmp_path, weight, GGMLQuantizationType.Q4_1)
    (ours,) = read_gguf(tmp_path / "t.gguf").tensors
    assert (ours.name, tuple(ours.shape), ours.tensor_type) == (tensor.name, (96, 64), tensor.tensor_type)
    assert np.array_equal(ours.data, tensor.data)


def test_row_order_undoes_llama_cpps_rotary_permutation():
    heads, head_dim = 3, 8
    original = np.arange(heads * head_dim)
    # llama.cpp's converter: per head, halves -> interleaved pairs.
    permuted = original.reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    assert (permuted[unpermuted_rows(heads * head_dim, heads)] == original).all()


def test_quantize_linears_replaces_every_linear_and_keeps_the_output_layer_int8():
    net = torch.nn.Module()
    net.body = torch.nn.Linear(64, 32)
    net.lm_head = torch.nn.Linear(32, 80, bias=False)
    assert quantize_linears(net, "int4") == 2
    assert isinstance(net.body, Int4Linear) and isinstance(net.lm_head, Int8Linear)


def test_auto_serves_the_default_model_quantized_on_the_cpu_only():
    assert choose_quantization("auto", CPU, model_is_default=True) == AUTO_DEFAULT_MODEL_CPU
    assert choose_quantization("auto", CPU, model_is_default=False) == "none"
    assert choose_quantization("int8", CPU, model_is_default=False) == "int8"


@pytest.mark.parametrize(("int4_s", "int8_s", "chosen"), [(2e-3, 1e-3, "int8"), (1e-3, 2e-3, "int4")])
def test_auto_on_the_cpu_takes_the_scheme_measured_faster_on_this_host(
    monkeypatch, caplog, int4_s, int8_s, chosen
):
    """The figures (faked here: timing is the host's) decide, not a constant; they are logged."""
    from worker.model import loader
    from worker.quant.auto_choice import Measured, ModelShapes

    asked: list[tuple[ModelShapes, int]] = []

    def fake_measure(shapes, batch_hint, cache):
        asked.append((shapes, batch_hint))
        return Measured({"int4": int4_s, "int8": int8_s}, (1, 3), 0.02, 5)

    shapes = ModelShapes(((128, 64), (64, 128)), 5)
    monkeypatch.setattr(loader, "measure_once", fake_measure)
    with caplog.at_level("INFO", logger="worker.model.loader"):
        got = choose_quantization("auto", CPU, model_is_default=True, shapes=lambda: shapes, batch_hint=16)
    assert got == chosen and asked == [(shapes, 16)]
    assert f"--quantization auto: {chosen} (measured on this host" in caplog.text
    assert "int4 2.000 ms" in caplog.text or "int4 1.000 ms" in caplog.text


def test_the_measurement_is_a_decode_pass_through_the_models_layers(monkeypatch):
    """One layer's weights stay in a core's cache and time the arithmetic, not the memory a decode
    step reads: the pass multiplies every layer of the model (up to PASS_BYTES), in order, at each row
    count, and the schemes' figures are those passes."""
    from worker.quant import auto_choice
    from worker.quant.auto_choice import ModelShapes, measure, model_shapes, pass_layers

    built: list[tuple[str, int, int]] = []
    real_layer = auto_choice._layer
    monkeypatch.setattr(
        auto_choice, "_layer", lambda scheme, o, i: built.append((scheme, o, i)) or real_layer(scheme, o, i)
    )
    shapes = ModelShapes(((64, 32), (32, 64)), layers=6)
    measured = measure(shapes, batch_hint=16)
    assert set(measured.seconds) == {"int4", "int8"} and all(s > 0 for s in measured.seconds.values())
    assert measured.rows == (1, 3) and measured.layers == 6 and measured.choice in ("int4", "int8")
    assert built == [(s, o, i) for s in ("int4", "int8") for _ in range(6) for o, i in shapes.linears]
    assert "through 6 layers" in measured.describe()
    monkeypatch.setattr(auto_choice, "PASS_BYTES", 3 * 64 * 32)  # room for one and a half layers
    assert pass_layers(shapes) == 1 and pass_layers(ModelShapes(((64, 32),), 6)) == 3
    config = type("Config", (), {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30})()
    assert model_shapes(config) == ModelShapes(((1536, 576), (1536, 576), (576, 1536)), 30)
    assert model_shapes(type("Config", (), {"hidden_size": 40})()) == ModelShapes((), 1)  # no whole groups


def test_the_first_measurement_on_a_host_decides_for_every_later_worker(monkeypatch, tmp_path):
    """Two workers that resume each other's streams must serve the same scheme: the figures are kept
    in the cache dir and a later start (another process) reads them instead of measuring again."""
    from worker.quant import auto_choice

    runs = iter([{"int4": 1e-3, "int8": 2e-3}, {"int4": 2e-3, "int8": 1e-3}, {"int4": 3e-3, "int8": 1e-3}])
    monkeypatch.setattr(
        auto_choice,
        "measure",
        lambda shapes, rows: auto_choice.Measured(next(runs), (1, 3), 0.01, shapes.layers),
    )
    one = auto_choice.ModelShapes(((64, 32),), 4)
    first = auto_choice.measure_once(one, 16, tmp_path)
    again = auto_choice.measure_once(one, 16, tmp_path)
    assert first.choice == again.choice == "int4" and again.seconds == first.seconds and again.layers == 4
    other = auto_choice.ModelShapes(((128, 32),), 4)
    assert auto_choice.measure_once(other, 16, tmp_path).choice == "int8"  # other shapes: measured
    # Figures kept by an older way of measuring are not read: a new METHOD measures again.
    monkeypatch.setattr(auto_choice, "METHOD", "another")
    assert auto_choice.measure_once(one, 16, tmp_path).seconds == {"int4": 3e-3, "int8": 1e-3}
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"] * 3  # no staging file left


def test_fp8_on_the_cpu_is_refused_naming_the_setting():
    with pytest.raises(ModelLoadError, match="--quantization fp8") as caught:
        choose_quantization("fp8", CPU, model_is_default=True)
    assert caught.value.param == "quantization"


def test_quantization_setting(capsys):
    assert parse_config([], environ={}).quantization == "auto"
    assert parse_config(["--quantization", "int4"], environ={}).quantization == "int4"
    assert parse_config([], environ={"SLUICE_WORKER_QUANTIZATION": "none"}).quantization == "none"
    with pytest.raises(SystemExit):
        parse_config(["--quantization", "int3"], environ={})
    assert "--quantization: must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_safetensors_folder_is_quantized_tensor_by_tensor(tiny_model_dir, scheme):
    plain = load_model(str(tiny_model_dir), device="cpu", dtype="float32", cpu_linear="torch")
    quantized = load_model(str(tiny_model_dir), device="cpu", dtype="float32", quantization=scheme)
    assert quantized.quantization == scheme
    layers = [m for m in quantized.model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert layers and not any(isinstance(m, torch.nn.Linear) for m in quantized.model.modules())
    # Every weight went to its own layer: each layer holds its checkpoint weight, quantized.
    for name, module in quantized.model.named_modules(remove_duplicate=False):
        if isinstance(module, (Int8Linear, Int4Linear)) and not name.endswith(".table"):  # tied: lm_head
            original = plain.model.get_submodule(name).weight
            assert relative_error(module.dequantized(), original) < (0.01 if scheme == "int8" else 0.1), name
    ids = torch.tensor([[1, 42, 7, 99, 3]])
    with torch.inference_mode():
        want, got = plain.model(input_ids=ids).logits, quantized.model(input_ids=ids).logits
    # A random model has no margin to spare: 4-bit rounding moves its logits by tens of percent.
    assert relative_error(got, want) < (0.05 if scheme == "int8" else 0.3)


def test_default_gguf_loads_its_own_blocks_without_a_float_conversion(tmp_path, monkeypatch):
    """The default model (Q4_1 blocks, a Q8_0 embedding tied to the output layer) loads int4 straight
    from the GGUF file: only its config and tokenizer are cached (the file's metadata parsed by
    transformers once, not once for the tokenizer and again for the config: about 2.5 CPU-s each),
    the layers hold the file's weights in transformers' row order, and it answers as the model does."""
    parses = []

    class CountedReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            parses.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountedReader)  # transformers imports it at each read
    loaded = load_model(None, device="cpu", dtype="float32", quantization="int4", cache_dir=tmp_path)
    assert len(parses) == 1, parses
    cached = [p.name for p in (tmp_path / "models").iterdir()]
    assert len(cached) == 1 and cached[0].endswith("-config")
    assert not list((tmp_path / "models" / cached[0]).glob("*.safetensors"))
    model, config = loaded.model, loaded.model.config
    assert isinstance(model.lm_head, Int8Linear) and model.model.embed_tokens.table is model.lm_head
    tensors = {t.name: t for t in read_gguf(default_gguf_path()).tensors}
    for name, module, heads in [
        ("blk.0.attn_q.weight", model.model.layers[0].self_attn.q_proj, config.num_attention_heads),
        ("blk.0.attn_k.weight", model.model.layers[0].self_attn.k_proj, config.num_key_value_heads),
        ("blk.5.ffn_down.weight", model.model.layers[5].mlp.down_proj, None),
        ("token_embd.weight", model.lm_head, None),
    ]:
        tensor = tensors[name]
        want = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(module.out_features, -1)
        if heads:  # llama.cpp's rotary row order, undone as transformers undoes it
            want = want.reshape(heads, -1, 2, want.shape[1]).swapaxes(1, 2).reshape(want.shape)
        assert relative_error(module.dequantized(), torch.from_numpy(want.astype(np.float32))) < 1e-2, name
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        best = model(input_ids=ids).logits[0, -1].argmax()
    assert loaded.tokenizer.decode(best).strip() == "Paris"


def test_int4_falls_back_to_int8_where_the_cpu_packing_wants_16_outputs():
    """The CPU int4 packing refuses an output width that is not a multiple of 16 (a 4-expert
    router); such a layer gets the int8 kernel, as one without whole input groups does."""
    layer = quantize_weight("int4", random_weight(4, 64))
    assert isinstance(layer, Int8Linear)
    x = torch.randn(3, 64)
    assert relative_error(layer(x), x @ random_weight(4, 64).t()) < 0.02
    assert isinstance(quantize_weight("int4", torch.randn(16, 64)), Int4Linear)
