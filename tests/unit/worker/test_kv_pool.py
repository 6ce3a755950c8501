"""The CPU KV pool's memory: allocated at start, its pages touched only as blocks are used (what
``--kv-cache-bytes`` promises), and zeros wherever nothing was written."""

from __future__ import annotations

import resource

import pytest
import torch

from worker.attention.kv_pool import KVPool, KVShape

MIB = 1 << 20


def resident_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("cache", ["auto", "int8"])
def test_a_cpu_pool_touches_no_page_until_a_block_is_written(cache: str) -> None:
    """A pool of 4 layers of 4096 blocks (256 MiB in float32, 82 MiB as int8 codes and scales)
    raises the resident memory by less than 16 MiB at start (``torch.zeros`` wrote all of it),
    reads zeros, and a written block reads back."""
    shape = KVShape.uniform(4, kv_heads=2, head_dim=64, dtype=torch.float32, cache=cache)
    before = resident_bytes()
    pool = KVPool(shape, 4096, 16, torch.device("cpu"))
    grown = resident_bytes() - before
    assert pool.bytes >= 64 * MIB
    assert grown < 16 * MIB, f"a {pool.bytes / MIB:.0f} MiB pool made {grown / MIB:.0f} MiB resident"
    layer = pool.layers[3]
    assert not layer.keys[4000].any() and not layer.values[17].any()
    if layer.key_scales is not None:
        assert not layer.key_scales[4000].any()
    code = torch.ones((16, 2, 64), dtype=layer.keys.dtype)
    layer.keys[4000] = code
    assert torch.equal(layer.keys[4000], code) and not layer.keys[3999].any()
    assert not pool.layers[2].keys[4000].any()  # each layer its own memory
