"""oneDNN-packed linear layers: same results as nn.Linear, every layer replaced, a clean fallback."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from worker.model.loader import load_model
from worker.model.packed_linear import PackedLinear, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.float32), reason="this torch build cannot pack weights for oneDNN"
)


def small_net(dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 40, bias=False)
    ).to(dtype)


@pytest.mark.parametrize("rows", [1, 3, 16, 50])
def test_packed_layers_compute_what_nn_linear_computes(rows):
    net = small_net()
    x = torch.randn(rows, 7, 64)
    with torch.inference_mode():
        want = net(x)
        assert pack_linears(net, batch_hint=16) == 2
        got = net(x)
    assert all(not isinstance(m, torch.nn.Linear) for m in net.modules())
    assert isinstance(net[0], PackedLinear) and net[0].bias is not None and net[2].bias is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_original_weight_is_released_before_the_next_layer_is_packed(monkeypatch):
    net = small_net()
    originals = [weakref.ref(net[0].weight), weakref.ref(net[2].weight)]
    alive_when_packing: list[list[bool]] = []
    pack = PackedLinear.__init__

    def recording_init(self, linear, batch_hint):
        gc.collect()
        alive_when_packing.append([ref() is not None for ref in originals])
        pack(self, linear, batch_hint)

    monkeypatch.setattr(PackedLinear, "__init__", recording_init)
    assert pack_linears(net, batch_hint=4) == 2
    # The second layer is packed after the first one's original weight is gone (peak memory: one
    # layer's extra copy, not the whole model's).
    assert alive_when_packing == [[True, True], [False, True]]
    gc.collect()
    assert [ref() for ref in originals] == [None, None]


def test_unsupported_dtype_leaves_the_model_as_it_was():
    net = small_net(torch.float16)
    assert pack_linears(net, batch_hint=16) == 0
    assert isinstance(net[0], torch.nn.Linear) and isinstance(net[2], torch.nn.Linear)


def test_a_layer_of_an_unsupported_dtype_keeps_nn_linear():
    net = small_net()
    net[2] = net[2].to(torch.float16)
    assert pack_linears(net, batch_hint=4) == 1
    assert isinstance(net[0], PackedLinear) and isinstance(net[2], torch.nn.Linear)


def test_a_wrong_packed_result_leaves_the_model_as_it_was(monkeypatch):
    net = small_net()
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: torch.zeros(x.shape[0], self.out_features))
    assert pack_linears(net, batch_hint=16) == 0
    assert isinstance(net[0], torch.nn.Linear)


def test_loaded_model_is_packed_and_gives_the_same_logits(tiny_model_dir):
    packed = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    plain = load_model(str(tiny_model_dir), device="cpu", dtype="float32", cpu_linear="torch")
    linears = sum(isinstance(m, torch.nn.Linear) for m in plain.model.modules())
    assert linears > 0
    assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == linears
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.model.modules())
    ids = torch.tensor([[1, 5, 9, 200, 31, 7]])
    with torch.inference_mode():
        want, got = plain.model(input_ids=ids).logits, packed.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
