"""Which kernels a hybrid model's recurrent mixers run (worker/model/mixer_kernels.py): on the CPU
here transformers resolved every kernel function to its torch form, so ``--require-mixer-kernels``
refuses at load in one line and the fast-path metric's ``mixers`` part says 0 (torch forms); a
resolution to the packages' kernels (injected) passes both."""

from __future__ import annotations

import pytest

from tests.tiny_families import HYBRID_FAMILIES, tiny_config, tiny_model
from tests.unit.worker.test_model_families import loaded
from worker import metrics
from worker.config import parse_config
from worker.engine.stats import EngineCounters, EngineStats
from worker.model import mixer_kernels, runner_setup
from worker.model.loader import ModelLoadError
from worker.model.recurrent import find_mixers

pytestmark = pytest.mark.slow  # left out of make test-fast

# The kernel functions transformers 5.24 gives each kind of mixer, by import name and package.
GATED_DELTANET = {
    ("causal_conv1d_fn", "causal_conv1d"),
    ("causal_conv1d_update", "causal_conv1d"),
    ("chunk_gated_delta_rule", "fla"),
    ("fused_recurrent_gated_delta_rule", "fla"),
}
MAMBA2 = {
    ("causal_conv1d_fn", "causal_conv1d"),
    ("causal_conv1d_update", "causal_conv1d"),
    ("mamba_split_conv1d_scan_combined", "mamba_ssm"),
    ("selective_state_update", "mamba_ssm"),
    ("mamba_chunk_scan_combined", "mamba_ssm"),
}
EXPECTED = {
    "qwen3_5_text": GATED_DELTANET,
    "qwen3_5_moe_text": GATED_DELTANET,
    "qwen3_next": GATED_DELTANET,
    "granitemoehybrid": MAMBA2,
    "nemotron_h": MAMBA2,
    "falcon_h1": MAMBA2,
    "lfm2": {("causal_conv1d_fn", "causal_conv1d"), ("causal_conv1d_update", "causal_conv1d")},
}


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_each_mixer_runs_the_torch_forms_here(family: str) -> None:
    """Every hybrid family's mixer functions are found, each resolved to its torch form here."""
    kernels = mixer_kernels.mixer_kernels(find_mixers(tiny_model(tiny_config(family))))
    [functions] = kernels.functions.values()
    assert {(f.name, f.package) for f in functions} == EXPECTED[family]
    assert not any(f.kernel for f in functions) and not kernels.on_kernels
    assert kernels.describe().startswith("transformers' torch forms for ")


def test_require_mixer_kernels_refuses_the_torch_forms_in_one_line() -> None:
    model = loaded(tiny_model(tiny_config("qwen3_5_text")))
    config = parse_config(["--require-mixer-kernels"], environ={})
    with pytest.raises(ModelLoadError) as caught:
        runner_setup.model_runner(model, config)  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith("--require-mixer-kernels: the recurrent mixers would run transformers' torch")
    assert "Qwen3_5GatedDeltaNet: chunk_gated_delta_rule (flash-linear-attention)" in message
    assert "\n" not in message and caught.value.param == "require_mixer_kernels"


def test_the_fast_path_metric_says_the_mixers_run_torch_forms() -> None:
    """Served without the switch, the runner carries the choice to the metric (any device)."""
    config = parse_config(["--max-prefill-tokens", "64", "--kv-cache-bytes", str(2**20)], environ={})
    runner, _ = runner_setup.model_runner(loaded(tiny_model(tiny_config("lfm2"))), config)
    assert runner.mixers_on_kernels is False
    stats = EngineStats(0, 0, 0, 0, 0, 0, 0, EngineCounters(), mixers_on_kernels=runner.mixers_on_kernels)
    text = metrics.render(stats, "m")
    assert 'sluice_worker_fast_path{model="m",part="mixers"} 0.0' in text
    assert 'part="kernel"' not in text and "sluice_worker_decode_graph_replays" not in text  # CUDA parts


def test_an_attention_model_has_no_mixers_to_require() -> None:
    model = loaded(tiny_model(tiny_config("llama")))
    assert mixer_kernels.checked_mixer_kernels(model.model, require=True) is None


def test_kernels_resolved_pass_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where transformers resolved every function to its package (a CUDA host with the packages,
    injected here), the switch passes and the metric says 1."""
    real = mixer_kernels.resolution

    def resolved(function):  # type: ignore[no-untyped-def]
        found = real(function)
        return None if found is None else mixer_kernels.KernelFunction(found.name, found.package, True)

    monkeypatch.setattr(mixer_kernels, "resolution", resolved)
    model = tiny_model(tiny_config("granitemoehybrid"))
    assert mixer_kernels.checked_mixer_kernels(model, require=True) is True
    kernels = mixer_kernels.mixer_kernels(find_mixers(model))
    assert kernels.describe() == "the kernels of causal-conv1d, mamba-ssm"
    text = metrics.render(EngineStats(0, 0, 0, 0, 0, 0, 0, EngineCounters(), mixers_on_kernels=True), "m")
    assert 'sluice_worker_fast_path{model="m",part="mixers"} 1.0' in text
