"""The KV bench's measured-not-kept key smoothing (bench/kv_key_smoothing.py): its vectors and the
pool patch it measures with (one tiny pool, no model)."""

from __future__ import annotations

import pytest
import torch

from bench import kv_key_smoothing as smoothing
from worker.attention import kv_quant
from worker.attention.kv_pool import KVPool, KVShape, LayerCache


def test_vectors_are_equal_on_rotary_pairs_and_floored() -> None:
    magnitude = torch.tensor([[8.0, 0.0, 1.0, 0.0, 2.0, 0.0, 4.0, 0.0]])
    s = smoothing.smoothing(magnitude)
    assert torch.equal(s[..., :4], s[..., 4:])  # channels i and i + d/2 rotate into each other
    assert float(s.max()) == 1.0 and float(s.min()) == pytest.approx(smoothing.FLOOR)


def test_smoothed_keys_round_trip_one_scale_per_head_and_restore() -> None:
    originals = (LayerCache.write, LayerCache.stored, LayerCache.gather, dict(kv_quant.KEY_GROUP_DIMS))
    outlier = torch.ones(64)
    outlier[[3, 35]] = 100.0  # one rotary pair of outlier channels
    keys = (torch.randn((5, 2, 64), generator=torch.Generator().manual_seed(0)) * outlier).float()
    vectors: list[torch.Tensor | None] = [smoothing.smoothing(outlier.expand(2, 64))]
    with smoothing.smoothed_keys(vectors) as attach:
        pool = KVPool(KVShape.uniform(1, 2, 64, torch.float32, cache="int8"), 2, 8, torch.device("cpu"))
        layer = pool.layers[0]
        assert layer.key_scales is not None and layer.key_scales.shape[-1] == 1  # one per head
        attach(_Runner(pool))  # type: ignore[arg-type]  # attach reads the runner's pool only
        layer.write(torch.arange(5), keys, keys)
        smoothed = layer.gather(torch.tensor([0]), torch.float32)[0].reshape(-1, 2, 64)[:5]
        assert torch.equal(layer.stored(keys, torch.float32, True), smoothed)
        unsmoothed = kv_quant.KVQuant("int8").round_trip(keys, True)  # one scale per head, unsmoothed
    inliers = outlier == 1.0
    assert (smoothed - keys)[..., inliers].abs().max() < (unsmoothed - keys)[..., inliers].abs().max() / 4
    assert originals == (LayerCache.write, LayerCache.stored, LayerCache.gather, kv_quant.KEY_GROUP_DIMS)


class _Runner:
    """What :func:`smoothing.smoothed_keys`'s attach reads of a runner: its pool."""

    def __init__(self, pool: KVPool):
        self.pool = pool
